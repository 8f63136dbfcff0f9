"""The pieces of data parallelism, one process: placement, shards, buckets, the gradient
sums started during the last backward, the losses of every replica."""

from __future__ import annotations

import pytest
import torch
from ftpipe_runtime.engine.split_backward import backward_input, backward_weight
from ftpipe_runtime.errors import PipelineConfigError
from ftpipe_runtime.schedules import StageInfo, actions
from ftpipe_runtime.train.precision import MixedPrecision, get_precision
from ftpipe_runtime.train.replicas import (
    GradSync,
    LossGather,
    Replicas,
    Shard,
    StepBackwards,
    bucket_indices,
    launch_hint,
)
from torch import nn


def test_buckets_hold_the_last_parameters_first():
    assert bucket_indices([10, 10, 10, 30, 1], limit=25) == [[4], [3], [2, 1], [0]]
    assert bucket_indices([5] * 4, limit=100) == [[3, 2, 1, 0]]
    assert bucket_indices([]) == []


def test_placement():
    plan = {"gpus": 2, "replicas": 2, "placement": [[0, 0], [1, 0], [0, 1], [1, 1]]}
    reps = Replicas.of(plan)
    assert (reps.world, reps.where(1), reps.rank(1, 1)) == (4, (1, 0), 3)
    assert reps.pipeline(1) == (1, 3) and reps.stage_group(0) == (0, 1)
    assert Replicas.of({"gpus": 3}).pipeline(0) == (0, 1, 2)  # a plan of one pipeline
    with pytest.raises(PipelineConfigError, match="exactly one rank"):
        Replicas.of({**plan, "placement": [[0, 0], [0, 0], [0, 1], [1, 1]]})
    with pytest.raises(PipelineConfigError, match="exactly one rank"):
        Replicas.of({"gpus": 2, "replicas": 2})  # two replicas need a placement


def test_shards_split_each_step_between_the_replicas():
    class Numbers:
        def get(self, name, mb):
            return mb

    m, d = 3, 2
    seen = [[Shard(Numbers(), r, d, m).get("x", mb) for mb in range(2 * m)] for r in range(d)]
    assert seen == [[0, 1, 2, 6, 7, 8], [3, 4, 5, 9, 10, 11]]  # step 0: 0..5, step 1: 6..11


def _last_backwards(acts, m, kind="B"):
    """{(stage, step): mb} of the backwards StepBackwards calls last, as they stream by
    (`kind` "W": a split backward, whose gradient hooks the executor calls at W)."""
    last, found = StepBackwards(m), {}
    for a in acts:
        if a.kind == kind and last.ends_step(a.stage):
            found[(a.stage, a.mb // m)] = a.mb
    return found


def test_last_backward_of_each_step():
    stages = [StageInfo(0, 0, 1, False), StageInfo(1, 1, 0, True)]
    gpipe = actions("gpipe", stages, 3, 2)[0]  # backwards of a step in reverse
    assert _last_backwards(gpipe, 3) == {(0, 0): 0, (0, 1): 3}
    ftpipe = actions("ftpipe", stages, 3, 2)[0]
    assert _last_backwards(ftpipe, 3) == {(0, 0): 2, (0, 1): 5}


def test_a_split_backward_ends_its_step_at_its_last_w():
    stages = [StageInfo(0, 0, 1, False), StageInfo(1, 1, 0, True)]
    acts = actions("zb1p", stages, 3, 2)[0]
    found = _last_backwards(acts, 3, "W")
    assert found == {(0, 0): 2, (0, 1): 5}
    for (s, _), mb in found.items():  # every W of its step, hence every gradient, is in by then
        at = acts.index(next(a for a in acts if (a.kind, a.stage, a.mb) == ("W", s, mb)))
        done = {a.mb for a in acts[: at + 1] if a.kind == "W" and a.stage == s}
        assert set(range(mb - 2, mb + 1)) <= done


def test_losses_of_all_replicas_in_replica_order():
    got = {}
    gather = LossGather([0, 5], lambda k, msg: got.setdefault(k, msg))
    gather.add(0, 5, torch.tensor([3.0, 4.0, 9.0]))  # losses, then the time it finished
    assert got == {}
    gather.add(0, 0, torch.tensor([1.0, 2.0, 7.0]))
    assert got[0].tolist() == [1.0, 2.0, 3.0, 4.0, 9.0]


def test_launch_hint():
    plan = {"gpus": 4, "replicas": 4, "placement": [divmod(r, 4) for r in range(16)]}
    assert launch_hint(plan) == "--nproc_per_node 16"
    plan["cluster"] = {"gpus_per_node": 8}
    assert launch_hint(plan).startswith("--nnodes 2 --nproc_per_node 8 --rdzv-backend c10d")


class _Twice:
    """A pretend group of two identical replicas: a sum is twice the value."""

    def __init__(self):
        self.started, self.finished, self.sent = [], False, []

    def all_reduce_async(self, tensor, ranks):
        self.started.append((tensor.numel(), self.finished))
        self.sent.append(tensor.clone())
        tensor.mul_(2)
        return None

    def wait(self, work, what):
        pass


def test_buckets_start_during_the_last_backward_and_average():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64), nn.Linear(64, 4))
    comm = _Twice()
    limit = 64 * 64 * 4  # one weight per bucket
    mixed = MixedPrecision(get_precision("fp32"), {0: net})
    sync = GradSync(mixed, comm, (0, 1), 2)  # 2 micro-batches: the second ends the step
    sync.order = {0: bucket_indices([p.numel() * 4 for p in sync.params[0]], limit)}
    for mb in range(2):
        x = torch.randn(8, 64)
        sync.before_backward(0, mb)
        net(x).square().mean().backward()
        comm.finished = True
        sync.after_backward(0, mb)
        comm.finished = False
        if mb == 0:
            assert comm.started == []  # not the step's last backward
    want = [p.grad.clone() for p in net.parameters()]
    sizes = [n for n, _ in comm.started]
    assert sum(sizes) == sum(p.numel() for p in net.parameters())
    assert sizes[0] == 4 + 4 * 64 + 64  # the last layer and the bias before it, first
    assert not comm.started[0][1]  # ... while the backward still ran
    sync.wait(0, 0)
    for p, w in zip(net.parameters(), want):  # twice the sum, halved: the mean
        torch.testing.assert_close(p.grad, w)


@pytest.mark.parametrize("split", [False, True], ids=["backward", "B-then-W"])
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_16_bit_replicas_sum_the_fp32_master_gradients(dtype, split):
    """What the replicas sum is the masters' fp32 gradient of the step's micro-batches (not
    the 16-bit weights', which the masters took), whichever way the gradients came: autograd's
    backward, or a split backward's W; the mean lands in the masters."""
    torch.manual_seed(0)
    precision = get_precision(dtype)
    net = nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4)).to(precision.dtype)
    mixed = MixedPrecision(precision, {0: net})
    comm = _Twice()
    sync = GradSync(mixed, comm, (0, 1), 2)
    sync.order = {0: bucket_indices([t.numel() * 4 for t in sync.params[0]], 16 * 16 * 4)}
    for mb in range(2):
        x = torch.randn(8, 16, dtype=precision.dtype, requires_grad=True)
        loss = net(x).float().square().mean()
        if split:
            later = backward_input([loss], [None], [x], list(net.parameters()))
            sync.before_backward(0, mb)  # with a split backward, GradSync is armed at W
            backward_weight(later, mixed.add_grad)
        else:
            sync.before_backward(0, mb)
            loss.backward()
        sync.after_backward(0, mb)
    masters = [t for _, t in mixed.trainable(0)]
    assert all(p.grad is None for p in net.parameters())  # the masters took them
    summed = torch.cat(comm.sent)
    assert summed.dtype == torch.float32 and summed.abs().sum() > 0
    want = torch.cat([t.grad.reshape(-1) for t in reversed(masters)])  # last buckets first
    assert torch.equal(summed, want)
    before = [t.grad.clone() for t in masters]
    sync.wait(0, 0)
    for t, b in zip(masters, before):  # twice the sum, halved: the mean
        torch.testing.assert_close(t.grad, b, rtol=0, atol=0)
