"""The hook around every action: `--trace FILE` lists each rank's actions, in the order the
schedule gives them, with when each started and ended and how long it waited."""

from __future__ import annotations

import pytest
from ftpipe_runtime.errors import PipelineConfigError
from ftpipe_runtime.schedules import actions
from ftpipe_runtime.topology import Topology
from ftpipe_runtime.trace import read_trace
from runtime_toy import toy_plan

STEPS = 3


@pytest.mark.multiproc
def test_trace_lists_every_action_of_every_rank_in_order(run_pipeline, tmp_path):
    plan = toy_plan("two-ranks", "1f1b")
    trace = tmp_path / "trace.json"
    argv = ["--steps", str(STEPS), "--schedule", "1f1b", "--trace", str(trace)]
    codes, ranks = run_pipeline(plan, argv)
    assert codes == [0, 0], ranks.stderr()
    d = read_trace(trace)
    assert (d["schedule"], d["micro_batches"], d["steps"]) == ("1f1b", plan["micro_batches"], STEPS)
    lists = actions("1f1b", Topology(plan).stage_infos(), plan["micro_batches"], STEPS)
    assert sorted(r["gpu"] for r in d["ranks"]) == [0, 1]
    for r in d["ranks"]:
        rows = r["actions"]
        want = [("R" if a.recompute else a.kind, a.stage, a.mb) for a in lists[r["gpu"]]]
        assert [tuple(row[:3]) for row in rows] == want
        for (_, _, _, start, end, waited), nxt in zip(rows, [*rows[1:], None]):
            assert 0 <= start <= end and 0 <= waited <= end - start + 1e-6
            assert nxt is None or end <= nxt[3]


def test_a_file_that_is_not_a_trace_is_refused(tmp_path):
    path = tmp_path / "plan.json"
    path.write_text('{"kind": "ftpipe-plan"}')
    with pytest.raises(PipelineConfigError, match="is not an ftpipe trace"):
        read_trace(path)
