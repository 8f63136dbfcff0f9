"""PipeDream-2BW and WPipe in the runtime follow their update rules, written in the tests."""

from __future__ import annotations

import json

import pytest
import torch
from runtime_reference import checkpoint_params, train_delayed, train_plain
from runtime_toy import toy_plan

pytestmark = pytest.mark.multiproc

STEPS = 4
# WPipe on the toy's two ranks: stages 0, 1 are G0 (rank 0, 1), stages 2, 3 are G1.
DELAYS = {"2bw": {0: 1, 1: 1, 2: 1, 3: 1}, "wpipe": {0: 1, 1: 1, 2: 0, 3: 0}}


@pytest.mark.parametrize("schedule", ["2bw", "wpipe"])
def test_pipeline_follows_its_delayed_update_rule(run_pipeline, tmp_path, schedule):
    plan = toy_plan("two-ranks", schedule)
    ckpt, log = tmp_path / "ckpt", tmp_path / "log.json"
    argv = ["--steps", str(STEPS), "--optimizer", "adam", "--lr", "0.05", "--clip", "0"]
    argv += ["--save-every", str(STEPS), "--checkpoint-dir", str(ckpt), "--log-json", str(log)]
    codes, ranks = run_pipeline(plan, argv)
    assert codes == [0, 0], ranks.stderr()

    losses, weights = train_delayed(plan, STEPS, DELAYS[schedule], "adam", lr=0.05)
    assert json.loads(log.read_text())["losses"] == pytest.approx(losses, rel=1e-5)
    got = checkpoint_params(ckpt, STEPS, range(4))
    for params in weights.values():
        for name, value in params.items():
            torch.testing.assert_close(got[name], value, rtol=1e-5, atol=1e-6, msg=name)


def test_the_delayed_rules_differ_from_each_other_and_from_plain_training():
    """So matching one is not matching another: 2BW, WPipe and plain SGD part after step 1."""
    plan = toy_plan("two-ranks", "2bw")
    plain, _ = train_plain(plan, STEPS, "adam", lr=0.05)
    zero, _ = train_delayed(plan, STEPS, dict.fromkeys(range(4), 0), "adam", lr=0.05)
    assert zero == pytest.approx(plain, rel=1e-6)  # delay 0 is plain training
    two_bw, _ = train_delayed(plan, STEPS, DELAYS["2bw"], "adam", lr=0.05)
    wpipe, _ = train_delayed(plan, STEPS, DELAYS["wpipe"], "adam", lr=0.05)
    assert two_bw[0] == pytest.approx(plain[0], rel=1e-6) == wpipe[0]  # nothing stepped yet
    for a, b in [(two_bw, plain), (wpipe, plain), (wpipe, two_bw)]:
        assert abs(a[1] - b[1]) > 1e-4 and abs(a[-1] - b[-1]) > 1e-4
