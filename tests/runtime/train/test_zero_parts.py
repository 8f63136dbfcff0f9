"""The parts of sharded optimizer state (`ftpipe_runtime.train.zero`) in one process: two
replicas, each in a thread, meet in a pretend process group (`_Pair`); the reference is the
same two replicas unsharded, whose all-reduce the same group sums, so the arithmetic is the
same and the weights are compared bit for bit."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest
import torch
from ftpipe_runtime.errors import PipelineConfigError
from ftpipe_runtime.freeze.layers import FreezeTraining
from ftpipe_runtime.job.config import RunConfig
from ftpipe_runtime.job.prepare import _sharded, sharded_stages
from ftpipe_runtime.train.optim import Hyper, make_optimizer, state_bytes
from ftpipe_runtime.train.precision import MixedPrecision, get_precision
from ftpipe_runtime.train.replicas import GradSync
from ftpipe_runtime.train.zero import ShardedOptimizer, layout
from torch import nn

HYPER = Hyper(weight_decay=0.01)


class _Pair:
    """The collectives of two replicas, each calling from its own thread: every call waits
    for the other replica's, then both take their part of the result."""

    def __init__(self):
        self.barrier, self.slots = threading.Barrier(2), [None, None]

    def meet(self, i: int, t: torch.Tensor) -> list[torch.Tensor]:
        self.slots[i] = t.clone()
        self.barrier.wait()
        both = list(self.slots)
        self.barrier.wait()
        return both


class _Comm:
    device = torch.device("cpu")

    def __init__(self, pair: _Pair, i: int):
        self.pair, self.i = pair, i
        self.sent = {}

    def all_reduce_async(self, tensor, ranks):
        a, b = self.pair.meet(self.i, tensor)
        tensor.copy_(a + b)

    def reduce_scatter_async(self, out, flat, ranks):
        a, b = self.pair.meet(self.i, flat)
        out.copy_(a.chunk(2)[self.i] + b.chunk(2)[self.i])

    def all_gather_async(self, out, shard, ranks, kind="weights"):
        out.copy_(torch.cat(self.pair.meet(self.i, shard)))

    def all_reduce(self, tensor, ranks, what, replicas=False):
        if replicas:
            a, b = self.pair.meet(self.i, tensor)
            tensor.copy_(a + b)
        return tensor

    def wait(self, work, what):
        pass


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(24, 200), nn.Tanh(), nn.Linear(200, 8))


def _replica(i, pair, net, sharded: bool, dtype: str, freeze_after, steps: int = 4):
    """One replica's run: its half of each step's batch, gradients summed with the other's
    (GradSync), stepped (AdamW, weight decay), the first layer frozen after `freeze_after`
    steps (FreezeTraining, forced). Returns (net, mixed, optimizer)."""
    precision = get_precision(dtype)
    net = net.to(precision.dtype)
    mixed = MixedPrecision(precision, {0: net}, sharded={0} if sharded else ())
    comm = _Comm(pair, i)
    if sharded:
        mixed.sharded_over = 2
        opt = ShardedOptimizer(mixed, 0, replicas=2, index=i, optimizer="adamw", lr=0.05,
                               hyper=HYPER)  # fmt: skip
    else:
        opt = make_optimizer("adamw", [t for _, t in mixed.trainable(0)], 0.05, HYPER)
    sync = GradSync(mixed, comm, (0, 1), 1)
    plan = {"params": [{"name": n} for n, _ in net.named_parameters()]}
    forced = {freeze_after: 1} if freeze_after else {}
    freezer = FreezeTraining(plan, {0: net}, {0: opt}, mixed, comm, alpha=None, every=1,
                             forced=forced)  # fmt: skip
    freezer.grad_sync = sync
    gen = torch.Generator().manual_seed(i)
    for step in range(steps):
        x = torch.randn(6, 24, generator=gen).to(precision.dtype)
        sync.before_backward(0, step)
        net(x).float().square().mean().backward()
        sync.after_backward(0, step)
        sync.wait(0, step)
        ev = SimpleNamespace(step=step, stages=(0,), ranks=(0,))
        freezer.measure(ev)
        opt.step()
        mixed.after_step(0)
        for _, t in mixed.stepped(0):
            t.grad = None
        freezer.after_step(ev, step)
    return net, mixed, opt


def _both(sharded: bool, dtype: str, freeze_after=None):
    pair, out = _Pair(), [None, None]
    nets = [_net(), _net()]  # made here: the threads share torch's generator

    def go(i):
        out[i] = _replica(i, pair, nets[i], sharded, dtype, freeze_after)

    threads = [threading.Thread(target=go, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(out), "a replica failed"
    return out


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("freeze_after", [None, 2], ids=["plain", "frozen after 2"])
def test_shards_train_as_the_whole_and_gather_into_its_state(dtype, freeze_after):
    """Each replica steps its half of every tensor (the 200x24 weight cut between them) and
    the gathered weights equal the unsharded replicas' bit for bit; after freezing the first
    layer the shards are laid out again over the second alone; gathered, the masters and
    the optimizer state are the unsharded optimizer's, as its `state_dict` has them."""
    sharded = _both(True, dtype, freeze_after)
    plain = _both(False, dtype, freeze_after)
    for (net, mixed, opt), (ref, _, _) in zip(sharded, plain, strict=True):
        for (name, p), (_, q) in zip(net.named_parameters(), ref.named_parameters(), strict=True):
            assert torch.equal(p, q), name
            assert p.requires_grad == q.requires_grad == (freeze_after is None or name[0] == "2")
        assert {p.name for p, _ in opt.pieces} <= {n for n, _ in mixed.trainable(0)}
    pair = _Pair()
    gathered = [None, None]

    def gather(i):
        opt = sharded[i][2]
        opt.bind(_Comm(pair, i), (0, 1))
        gathered[i] = opt.gather()

    threads = [threading.Thread(target=gather, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    _, ref_mixed, ref_opt = plain[0]
    for name, master in ref_mixed.trainable(0):
        assert torch.equal(gathered[0].masters[name], master.detach()), name
    want, got = ref_opt.state_dict(), gathered[1].state_dict()
    assert got["param_groups"] == want["param_groups"]
    assert got["state"].keys() == want["state"].keys()
    for k, state in want["state"].items():
        for key, value in state.items():
            assert torch.equal(got["state"][k][key], value.cpu()), (k, key)


def test_a_replica_keeps_half_of_the_masters_and_state():
    """Measured on the tensors: bf16 with fp32 masters, AdamW after a step; a replica's
    masters and moments are half the unsharded ones (to the alignment's padding)."""
    (_, mixed, opt), _ = _both(True, "bf16", None)
    (_, ref_mixed, ref_opt), _ = _both(False, "bf16", None)
    assert abs(state_bytes(opt) / state_bytes(ref_opt) - 0.5) < 0.02
    assert abs(mixed.master_bytes() / ref_mixed.master_bytes() - 0.5) < 0.03


def test_layout_aligns_tensors_and_chunks():
    """Each tensor starts at a multiple of 32 elements, d equal chunks of such multiples
    cover the bucket, the gather dtype is the weights'."""
    tensors = [torch.zeros(5, 7), torch.zeros(40), torch.zeros(3)]
    weights = [t.bfloat16() for t in tensors]
    (bucket,) = layout(tensors, weights, replicas=3)
    assert bucket.members == (2, 1, 0)  # the last parameters first, as the backward
    assert bucket.offsets == (0, 32, 96) and bucket.numel == 96 + 35
    assert bucket.chunk % 32 == 0 and bucket.chunk * 3 >= bucket.numel > bucket.chunk * 2
    assert bucket.gathered == torch.bfloat16 and bucket.dtype == torch.float32


# --- which stages are sharded, and what is refused ---


def _question(replicas=2, shrinks=None, **given):
    """`_sharded`'s question for these options, and what it said."""
    config = RunConfig(**{"shard_optimizer": True, "optimizer": "adamw", **given})
    said = []
    plan = {"stages": [{"id": 0}, {"id": 1, "shard_optimizer": True}]}
    shrinking = shrinks is not None

    def ask():
        return _sharded(plan, config, replicas=replicas, shrinking=shrinking, say=said.append)

    return ask, said


def test_the_flag_overrides_the_plans_stages():
    plan = {"stages": [{"id": 0}, {"id": 1, "shard_optimizer": True}]}
    assert sharded_stages(plan, None) == {1}  # the compiler's choice
    assert sharded_stages(plan, True) == {0, 1}
    assert sharded_stages(plan, False) == set()


@pytest.mark.parametrize(
    ("given", "match"),
    [
        ({"optimizer": "adafactor"}, "--optimizer adafactor cannot step a replica's slice"),
        ({"offload_optimizer": True}, "--offload-optimizer and sharded optimizer state do not"),
        ({"shrinks": object()}, "does not hand over to a shorter pipeline yet; add --no-shrink"),
    ],
)
def test_what_cannot_shard_is_refused_in_one_sentence(given, match):
    ask, _ = _question(**given)
    with pytest.raises(PipelineConfigError, match=match):
        ask()
    ask, _ = _question(**{**given, "shard_optimizer": False})
    assert ask() == set()  # --no-shard-optimizer: nothing to refuse


def test_one_replica_shards_nothing_and_says_so():
    ask, said = _question(replicas=1)
    assert ask() == set()
    assert said and "nothing is sharded" in said[0]
    ask, said = _question(replicas=1, shard_optimizer=None)  # the plan's choice: silently none
    assert ask() == set() and not said
