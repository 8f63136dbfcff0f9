"""The asynchronous schedule follows FTPipe's update rule, and still learns."""

from __future__ import annotations

import json

import pytest
import torch
from ftpipe_runtime.schedules import Timeline, get_schedule
from ftpipe_runtime.spec.topology import Topology
from runtime_reference import checkpoint_params, train_stale
from runtime_toy import toy_plan

pytestmark = pytest.mark.multiproc


def _lists(plan, steps):
    infos = Topology(plan).stage_infos()
    return Timeline(get_schedule("ftpipe"), infos, plan["micro_batches"], steps).lists()


@pytest.mark.parametrize("layout", ["two-ranks", "folded"])
def test_ftpipe_matches_stale_update_rule(run_pipeline, tmp_path, layout):
    """Folded: stage 3 reads stage 0's weight on the same rank, where a step of stage 0 comes
    between its forward and stage 3's: stage 3 must still use the value its forward read.
    Two ranks: the weight goes to rank 1 once per version of stage 0's weights (stage 0
    steps once a step), not with every micro-batch, and training is still the rule's."""
    plan, steps = toy_plan(layout, "ftpipe"), 4
    ckpt, log, trace = tmp_path / "ckpt", tmp_path / "log.json", tmp_path / "trace.json"
    argv = ["--steps", str(steps), "--optimizer", "adam", "--lr", "0.05", "--clip", "0"]
    argv += ["--save-every", str(steps), "--checkpoint-dir", str(ckpt), "--log-json", str(log)]
    codes, ranks = run_pipeline(plan, argv + ["--trace", str(trace)])
    assert codes == [0, 0], ranks.stderr()

    lists = _lists(plan, steps)
    losses, weights = train_stale(plan, lists, steps, "adam", lr=0.05)
    assert json.loads(log.read_text())["losses"] == pytest.approx(losses, rel=1e-4)
    got = checkpoint_params(ckpt, steps, range(4))
    for params in weights.values():
        for name, value in params.items():
            torch.testing.assert_close(got[name], value, rtol=1e-4, atol=1e-6, msg=name)
    # The versions stage 0's forwards read: its steps before each (counted from its list).
    versions, taken = set(), 0
    for a in lists[0]:
        taken += a.stage == 0 and a.kind == "S"
        if a.stage == 0 and a.kind == "F":
            versions.add(taken)
    sent = {r["rank"]: r["sent"] for r in json.loads(trace.read_text())["ranks"]}
    shape = next(t["shape"] for t in plan["transfers"] if t["tensor"] == "emb.weight")
    emb = 4 * shape[0] * shape[1]  # float32
    if layout == "two-ranks":
        assert len(versions) == steps
        assert sent[0]["weight"] == [len(versions), len(versions) * emb]
        assert sent[1]["wgrad"] == [steps, steps * emb]  # summed over each step
    else:  # on one rank: handed over in place
        assert "weight" not in sent[0] and "wgrad" not in sent.get(1, {})


@pytest.mark.parametrize("layout", ["two-ranks", "folded", "four-ranks"])
def test_a_lagged_offloaded_step_follows_the_rule_one_step_more_stale(
    run_pipeline, tmp_path, layout
):
    """--offload-optimizer --offload-step lagged: each stage's CPU step runs beside its next
    actions and lands at its next S, so they read its weights one step older than FTPipe's
    rule would (`train_stale(lag=1)`); the final masters are the last step's."""
    plan, steps = toy_plan(layout, "ftpipe"), 4
    ckpt, log = tmp_path / "ckpt", tmp_path / "log.json"
    argv = ["--steps", str(steps), "--optimizer", "adam", "--lr", "0.05", "--clip", "0"]
    argv += ["--save-every", str(steps), "--checkpoint-dir", str(ckpt), "--log-json", str(log)]
    argv += ["--offload-optimizer", "--offload-step", "lagged"]
    codes, ranks = run_pipeline(plan, argv)
    assert codes == [0] * len(codes), ranks.stderr()
    lists = _lists(plan, steps)
    losses, weights = train_stale(plan, lists, steps, "adam", lr=0.05, lag=1)
    got_losses = json.loads(log.read_text())["losses"]
    assert got_losses == pytest.approx(losses, rel=1e-4)
    got = checkpoint_params(ckpt, steps, range(4))
    for params in weights.values():
        for name, value in params.items():
            torch.testing.assert_close(got[name], value, rtol=1e-4, atol=1e-6, msg=name)
    exact, _ = train_stale(plan, lists, steps, "adam", lr=0.05)  # the rule without the lag
    assert abs(exact[-1] - got_losses[-1]) > 1e-3


def test_the_plan_lags_the_stages_it_says(run_pipeline, tmp_path):
    """The plan's per-stage choice (`offload.step`, no flag): stages 1 and 3 offloaded with
    lagged steps, 0 and 2 kept beside their weights; each follows its own rule."""
    plan, steps = toy_plan("two-ranks", "ftpipe"), 4
    for s in (1, 3):
        plan["stages"][s]["offload"] = {"optimizer": True, "step": "lagged"}
    log = tmp_path / "log.json"
    argv = ["--steps", str(steps), "--optimizer", "adam", "--lr", "0.05", "--clip", "0"]
    codes, ranks = run_pipeline(plan, argv + ["--log-json", str(log)])
    assert codes == [0, 0], ranks.stderr()
    lists = _lists(plan, steps)
    losses, _ = train_stale(plan, lists, steps, "adam", lr=0.05, lag={1: 1, 3: 1})
    got = json.loads(log.read_text())["losses"]
    assert got == pytest.approx(losses, rel=1e-4)
    for lag in (0, 1):  # neither every stage nor none
        other, _ = train_stale(plan, lists, steps, "adam", lr=0.05, lag=lag)
        assert abs(other[-1] - got[-1]) > 1e-3


def test_ftpipe_is_stale_not_synchronous(tmp_path):
    """The rule differs from plain training here, so matching it is not matching that."""
    from runtime_reference import train_plain

    plan, steps = toy_plan("two-ranks", "ftpipe"), 4
    stale, _ = train_stale(plan, _lists(plan, steps), steps, "adam", lr=0.05)
    plain, _ = train_plain(plan, steps, "adam", lr=0.05)
    assert stale[0] == pytest.approx(plain[0], rel=1e-6)  # nothing has stepped yet
    assert abs(stale[-1] - plain[-1]) > 1e-3


def test_ftpipe_loss_falls_on_copy_task(run_pipeline, tmp_path):
    plan, steps = toy_plan("three-ranks", "ftpipe"), 30
    log = tmp_path / "log.json"
    argv = ["--steps", str(steps), "--data", "copy", "--lr", "0.05", "--log-json", str(log)]
    codes, ranks = run_pipeline(plan, argv)
    assert codes == [0, 0, 0], ranks.stderr()
    losses = json.loads(log.read_text())["losses"]
    assert sum(losses[-5:]) / 5 < 0.5 * sum(losses[:5]) / 5, losses


def test_an_evaluation_reads_the_weights_the_next_forward_reads(run_pipeline, tmp_path):
    """A round mid-run evaluates, on every stage, the weights the forward of the next
    micro-batch reads there; the last round, after everything, the final weights. The tied
    embedding's reader holds the version it reads through the round (FTPipe's versions
    straddle the step the round follows), so no copy of it is sent for the round: a
    duplicate of the same value, one more embedding-sized buffer on each rank."""
    from ftpipe_runtime.data.batches import make_data
    from runtime_toy import B, D, L, V

    plan, steps = toy_plan("two-ranks", "ftpipe"), 4
    val, log, trace = tmp_path / "val.pt", tmp_path / "log.json", tmp_path / "trace.json"
    ids = torch.randint(0, V, (6, L), generator=torch.Generator().manual_seed(1))
    torch.save({"input_ids": ids, "labels": ids}, val)
    argv = ["--steps", str(steps), "--optimizer", "adam", "--lr", "0.05", "--clip", "0"]
    argv += ["--eval-data", str(val), "--eval-every", "2", "--log-json", str(log)]
    argv += ["--trace", str(trace)]
    codes, ranks = run_pipeline(plan, argv)
    assert codes == [0, 0], ranks.stderr()
    evals = make_data(plan["model"], str(val), 0, evaluation=True)
    m = plan["micro_batches"]
    losses, _, want = train_stale(
        plan, _lists(plan, steps), steps, "adam", lr=0.05, evaluate=(evals, [2 * m, None])
    )
    summary = json.loads(log.read_text())
    assert summary["losses"] == pytest.approx(losses, rel=1e-4)
    assert [e["step"] for e in summary["evals"]] == [2, 4]
    assert [e["loss"] for e in summary["evals"]] == pytest.approx(want, rel=1e-4)
    # Rank 0 sends rank 1 h0, x0, keep and h2 for each of the 2 rounds' 3 batches, and the
    # embedding once: with the last round's first batch.
    sent = {r["rank"]: r["sent"] for r in json.loads(trace.read_text())["ranks"]}
    batch = 3 * B * L * D * 4 + B * L * 8  # three fp32 activations and an int64 mask
    assert sent[0]["eval"] == [2 * 3 * 4 + 1, 2 * 3 * batch + V * D * 4]
