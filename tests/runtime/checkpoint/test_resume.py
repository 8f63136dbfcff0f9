"""A run stopped after a checkpoint and resumed is the uninterrupted run, under every schedule:
the same losses and the same final weights, bit for bit. (The uninterrupted run saves at the
same steps; the asynchronous schedule drains its pipeline there, `schedules.timeline`.)"""

from __future__ import annotations

import json

import pytest
import torch
from ftpipe_runtime.schedules import SCHEDULES
from runtime_helpers import crash_and_resume
from runtime_reference import checkpoint_params
from runtime_toy import L, V, toy_plan

pytestmark = pytest.mark.multiproc


def _some(names, everyday):
    """`names` as parameters, those outside `everyday` marked exhaustive (`make test-all`):
    each case is three 2-rank runs, and `make test` runs a representative few."""
    return [n if n in everyday else pytest.param(n, marks=pytest.mark.exhaustive) for n in names]


ARGV = ["--steps", "8", "--save-every", "2", "--data", "copy", "--optimizer", "adam"]
ARGV += ["--lr", "0.05"]


@pytest.mark.parametrize(
    "schedule", _some(["gpipe", "1f1b", "ftpipe", "2bw", "wpipe"], {"ftpipe", "2bw"})
)
def test_resume_is_the_uninterrupted_run(run_pipeline, tmp_path, schedule):
    """Two stages per rank, a weight read on the other rank, dropout in stage 1."""
    plan, env = toy_plan("two-ranks", schedule), {"FTPIPE_TOY_DROPOUT": "1"}
    whole, resumed = crash_and_resume(run_pipeline, tmp_path, plan, ARGV, range(4), env=env)
    first = resumed["first_step"]
    assert first in (2, 4)  # after a save: the newest checkpoint every rank finished
    assert resumed["losses"] == whole["losses"][first:]
    manifest = json.loads((tmp_path / "broken" / f"step-{first:06d}" / "rank-0.json").read_text())
    kept = {"2bw": {"0": [first - 1], "2": [first - 1]}, "wpipe": {"0": [first - 1]}}
    assert manifest["in_flight"] == {
        "drained": schedule == "ftpipe",
        "weight_versions": kept.get(schedule, {}),
    }


@pytest.mark.parametrize("schedule", _some(["ftpipe", "2bw"], {"ftpipe"}))
def test_resume_with_evaluation_rounds(run_pipeline, tmp_path, schedule):
    """Evaluation rounds spliced into the streamed actions: the resumed run evaluates the
    same weights at the same steps as the uninterrupted one."""
    ids = torch.randint(0, V, (6, L), generator=torch.Generator().manual_seed(1))
    torch.save({"input_ids": ids, "labels": ids}, tmp_path / "val.pt")
    argv = [*ARGV, "--eval-data", str(tmp_path / "val.pt"), "--eval-every", "2"]
    plan = toy_plan("two-ranks", schedule)
    whole, resumed = crash_and_resume(run_pipeline, tmp_path, plan, argv, range(4))
    first = resumed["first_step"]
    assert resumed["losses"] == whole["losses"][first:]
    assert [e["step"] for e in whole["evals"]] == [2, 4, 6, 8]
    assert resumed["evals"] == [e for e in whole["evals"] if e["step"] > first]


N, K = 2, 2  # train N steps, save at N (the final checkpoint), resume to N + K
FINAL = ["--data", "copy", "--optimizer", "adam", "--lr", "0.05", "--decay", "constant"]


@pytest.mark.slow
@pytest.mark.parametrize("schedule", _some(list(SCHEDULES), {"1f1b", "zbv"}))
def test_every_schedules_final_checkpoint_resumes(run_pipeline, tmp_path, schedule):
    """A finished run resumed for K more steps is the uninterrupted N + K run, bit for bit
    (a constant learning rate: a linear decay would follow --steps). Both save every N steps,
    so the schedules that drain at checkpoints drain at the same step."""
    plan = toy_plan("folded" if schedule == "zbv" else "two-ranks", schedule)

    def train(name, steps, folder, *extra):
        log = tmp_path / f"{name}.json"
        argv = [*FINAL, "--steps", str(steps), "--save-every", str(N), *extra]
        argv += ["--checkpoint-dir", str(tmp_path / folder), "--log-json", str(log)]
        codes, ranks = run_pipeline(plan, argv, name=name, env={"FTPIPE_TOY_DROPOUT": "1"})
        assert codes == [0, 0], ranks.stderr()
        return json.loads(log.read_text())

    whole = train("whole", N + K, "whole")
    train("first", N, "parts")
    resumed = train("resumed", N + K, "parts", "--resume")
    assert resumed["first_step"] == N
    assert resumed["losses"] == whole["losses"][N:]
    a = checkpoint_params(tmp_path / "whole", N + K, range(4))
    b = checkpoint_params(tmp_path / "parts", N + K, range(4))
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name
