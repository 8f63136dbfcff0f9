"""A loss that is not a number stops the run with one sentence (`report._diverged`): the
bad-input audit's weights of NaN trained to `loss nan` for every step and exited 0."""

from __future__ import annotations

import pytest
import torch
from ftpipe_runtime import run
from runtime_toy import PARAMS, STAGES, one_rank_plan


# nan: the first forward's loss; inf: a finite loss (the toy's tanh) but a nan gradient, which
# stops the run before its step (`stepping._finite`): no checkpoint of nan weights either way
@pytest.mark.parametrize(
    "value, said",
    [
        (float("nan"), "the loss of step 1 is nan (weights, a gradient or the data"),
        (float("inf"), "the gradient norm of step 1 is nan (stages 0, 1, 2, 3): a weight, an"),
    ],
)
def test_what_is_not_a_number_stops_the_run(value, said, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    weights = {name: torch.full(shape, 0.1) for name, shape in PARAMS.items()}
    weights["l1.weight"].fill_(value)  # one weight gone bad
    torch.save(weights, tmp_path / "w.pt")
    argv = ["--steps", "3", "--init", "w.pt", "--save-every", "1", "--checkpoint-dir", "ck"]
    with pytest.raises(SystemExit) as stopped:
        run(one_rank_plan(), STAGES, argv)
    assert str(stopped.value.code).startswith("ftpipe: " + said)
    assert "\n" not in str(stopped.value.code) and "step 2/" not in capsys.readouterr().err
    assert not list(tmp_path.rglob("rank-0.json"))  # no checkpoint of such weights


def test_finite_losses_run_on(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    summary = run(one_rank_plan(), STAGES, ["--steps", "2"])
    assert len(summary["losses"]) == 2
