"""The hook around every action: `--trace FILE` lists each rank's actions, in the order the
schedule gives them, with when each started and ended, how long it waited, its CPU time and
its page faults and kernel time."""

from __future__ import annotations

import mmap
import time

import pytest
from ftpipe_runtime.engine.trace import Tracer, read_trace
from ftpipe_runtime.errors import PipelineConfigError
from ftpipe_runtime.schedules import Action, actions
from ftpipe_runtime.spec.topology import Topology
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
        for (_, _, _, start, end, waited, cpu, faults, sys), nxt in zip(rows, [*rows[1:], None]):
            assert 0 <= start <= end and 0 <= waited <= end - start + 1e-6
            assert 0 <= cpu <= end - start + 0.01 and faults >= 0  # thread_time's grain
            assert 0 <= sys <= cpu + 0.01  # getrusage's grain is coarser
            assert nxt is None or end <= nxt[3]


def test_an_actions_cpu_time_and_page_faults_are_its_own():
    """Busy, asleep, and writing 16,384 fresh 4 KB pages (a 64 MB anonymous mapping, no huge
    pages asked for; enough kernel time for getrusage's tick-grained split): the row tells
    them apart."""
    tracer = Tracer(keep=True)

    def busy():  # 50 ms of this thread's CPU, however loaded the machine (not 50 ms of wall)
        end = time.thread_time() + 0.05
        while time.thread_time() < end:  # a system call: asked every 10,000 additions only
            sum(range(10_000))

    def fresh_pages():
        with mmap.mmap(-1, 64 << 20) as buf:  # mapped anew (malloc might reuse touched memory)
            for i in range(0, len(buf), 4096):
                buf[i] = 1

    for mb, work in enumerate((busy, lambda: time.sleep(0.05), fresh_pages)):
        with tracer.action(Action("F", 0, mb)):
            work()
    (*_, cpu_busy, _, sys_busy), (*_, cpu_asleep, _, _), (*_, faults, sys_fresh) = tracer.rows
    assert cpu_busy > 0.03 and cpu_asleep < 0.02
    assert faults >= 16000
    # Spinning in Python is user time; the kernel maps and zeroes the fresh pages.
    assert sys_busy < 0.5 * cpu_busy and sys_fresh > 0


def test_a_file_that_is_not_a_trace_is_refused(tmp_path):
    path = tmp_path / "plan.json"
    path.write_text('{"kind": "ftpipe-plan"}')
    with pytest.raises(PipelineConfigError, match="is not an ftpipe trace"):
        read_trace(path)
