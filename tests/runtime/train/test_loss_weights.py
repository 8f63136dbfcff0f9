"""A step's loss is its label tokens' sum over their number, across micro-batches and
replicas; an evaluation's loss is token-weighted too, whatever its batch size.

The shares are checked against counts made here (labels not -100 after a causal LM's
shift), the evaluation against the toy model run here on each evaluation batch."""

from __future__ import annotations

import json

import pytest
import torch
from ftpipe_runtime.data.batches import make_data
from ftpipe_runtime.train.loss_weights import LossWeights
from ftpipe_runtime.train.replicas import Shard
from runtime_toy import ToyModel, toy_plan, write_ragged


def _count(data, mb: int) -> int:
    return int(data.get("labels", mb)[:, 1:].ne(-100).sum())


def test_each_micro_batch_weighs_its_share_of_the_steps_tokens(tmp_path):
    data = make_data(toy_plan()["model"], write_ragged(tmp_path / "r.jsonl"), seed=0)
    m = 4
    weights = LossWeights(data, m)
    for step in range(3):
        mbs = range(step * m, (step + 1) * m)
        counts = [_count(data, mb) for mb in mbs]
        assert len(set(counts)) > 1  # the data makes the two rules differ
        for mb, n in zip(mbs, counts):
            assert weights.of(mb) == pytest.approx((n / sum(counts), n / sum(counts)))


def test_replicas_share_one_count_and_carry_their_number_back(tmp_path):
    """Two replicas of 2 micro-batches: a step is 4 micro-batches of the whole data; the
    gradient weight is twice the share, as the replicas' gradients are averaged."""
    data = make_data(toy_plan()["model"], write_ragged(tmp_path / "r.jsonl"), seed=0)
    shards = [LossWeights(Shard(data, r, 2, 2), 2) for r in range(2)]
    for step in range(3):
        whole = {g: _count(data, g) for g in range(step * 4, step * 4 + 4)}
        total = sum(whole.values())
        shares = []
        for r, weights in enumerate(shards):
            for j in range(2):
                grad, share = weights.of(step * 2 + j)
                assert share == pytest.approx(whole[(step * 2 + r) * 2 + j] / total)
                assert grad == pytest.approx(2 * share)
                shares.append(share)
        assert sum(shares) == pytest.approx(1.0)


def test_a_micro_batch_with_nothing_to_predict_weighs_nothing():
    model = toy_plan()["model"]

    class Data:  # one token per row in micro-batch 1: nothing left after the shift
        head = make_data(model, None, 0).head

        def get(self, name, mb):
            return torch.tensor([[3, -100], [4, -100]]) if mb == 1 else torch.tensor([[1, 2]] * 2)

    weights = LossWeights(Data(), 2)
    assert weights.of(1) == (0.0, 0.0)
    assert weights.of(0) == (1.0, 1.0)


@pytest.mark.multiproc
def test_the_evaluation_loss_is_token_weighted(run_pipeline, tmp_path):
    """lr 0: the evaluation after the step sees the initial weights; its loss is each batch's
    mean weighted by the batch's label tokens (the last batch half padding rows)."""
    plan = toy_plan("two-ranks")  # the loss stage on rank 1: its result travels to rank 0
    val = write_ragged(tmp_path / "val.jsonl", samples=7)
    log = tmp_path / "log.json"
    argv = ["--steps", "1", "--lr", "0", "--eval-data", val, "--eval-every", "1"]
    codes, ranks = run_pipeline(plan, [*argv, "--log-json", str(log)])
    assert codes == [0, 0], ranks.stderr()
    [result] = json.loads(log.read_text())["evals"]
    data = make_data(plan["model"], val, 0, evaluation=True)
    net, total, tokens = ToyModel(), 0.0, 0
    with torch.no_grad():
        for mb in range(data.micro_batches):
            loss = net(**{n: data.get(n, mb) for n in plan["model"]["inputs"]})
            total += float(loss) * _count(data, mb)
            tokens += _count(data, mb)
    assert result["samples"] == 7
    assert result["loss"] == pytest.approx(total / tokens, rel=1e-6)
