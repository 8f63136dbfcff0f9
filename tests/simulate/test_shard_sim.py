"""Sharded optimizer state across replicas (ZeRO-1) in the memory model and the simulator: a
stage with `shard_optimizer` keeps 1/replicas of its masters and optimizer state — what the
runtime's `ShardedOptimizer` holds, measured on its tensors — and sums its gradients by a
reduce-scatter, its step then ending with the all-gather of its new weights, each a pass of
the ring (`formulas.ring_s`)."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch
from ftpipe_runtime.train.optim import make_optimizer
from ftpipe_runtime.train.precision import MixedPrecision, get_precision
from ftpipe_runtime.train.zero import ALIGN, SHARDABLE, ShardedOptimizer
from sim_plans import make_plan
from test_replicas_sim import INTRA, replicated
from torch import nn

from ftpipe_compiler.costs.formulas import PRECISIONS, param_bytes, ring_s
from ftpipe_compiler.plan import PlanParam
from ftpipe_compiler.simulate import simulate
from ftpipe_compiler.simulate.network import shard_lines

MB = 1_000_000
SHAPES = {"a.weight": (200, 24), "a.bias": (200,), "b.weight": (8, 200), "b.bias": (8,)}
DTYPES = {"fp32": "float32", "bf16": "bfloat16"}


def _sharded(plan, on=(0,)):
    return plan.with_(
        stages=tuple(replace(s, shard_optimizer=s.id in on) for s in plan.stages),
        optimizer="adamw",
    )


def _toy_plan(dtype: str):
    """One stage owning SHAPES' parameters, 2 replicas, AdamW under `dtype`."""
    plan = replicated(make_plan([(0.1, 0.2, 0.1)], schedule="gpipe"), 2, 2)
    precision = PRECISIONS[dtype]
    params = tuple(
        PlanParam(n, shape, DTYPES[dtype], *_sizes(shape, DTYPES[dtype], precision), True, (), (0,))
        for n, shape in SHAPES.items()
    )
    stages = (replace(plan.stages[0], params=tuple(SHAPES)),)
    model = {**plan.model, "precision": dtype}
    return plan.with_(params=params, stages=stages, model=model, optimizer="adamw")


def _sizes(shape, dtype, precision):
    w, rest = param_bytes(shape, dtype, True, "adamw", precision)
    return w, w + rest


def _held(dtype: str, index: int | None) -> int:
    """Bytes of fp32 masters and AdamW moments one replica holds for SHAPES' tensors after a
    step, on the runtime's own tensors: sharded 2 ways (`index`: the replica), or whole."""
    precision = get_precision(dtype)
    torch.manual_seed(0)
    net = nn.ModuleDict({"a": nn.Linear(24, 200), "b": nn.Linear(200, 8)}).to(precision.dtype)
    if index is None:
        mixed = MixedPrecision(precision, {0: net})
        opt = make_optimizer("adamw", [t for _, t in mixed.trainable(0)], 0.1)
        stepped = [t for _, t in mixed.trainable(0)]
        masters = mixed.master_bytes()
    else:
        mixed = MixedPrecision(precision, {0: net}, sharded={0})
        opt = ShardedOptimizer(mixed, 0, replicas=2, index=index, optimizer="adamw", lr=0.1)
        stepped = [t for _, t in opt.pieces]
        masters = opt.master_bytes()
    for t in stepped:
        t.grad = torch.ones_like(t)
    opt.step()
    moments = sum(
        state[k].nbytes for state in opt.state.values() for k in SHARDABLE["adamw"]
    )  # the step counters (a scalar each) are not the model's
    return masters + moments


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_a_sharded_stage_keeps_what_the_runtime_s_shards_hold(dtype):
    """The memory model's masters and state of a sharded stage, per replica, are what each
    `ShardedOptimizer` holds to within its alignment padding (each tensor starts at a
    multiple of 32 elements, and the chunks are such multiples); unsharded, what the
    whole optimizer and `MixedPrecision` hold exactly."""
    plan = _toy_plan(dtype)
    sharded = _sharded(plan)
    stage = plan.stages[0]
    numel = sum(math.prod(s) for s in SHAPES.values())
    grads = numel * PRECISIONS[dtype].grad  # summed whole on every replica either way
    model_whole = plan.state_bytes(stage) - grads
    model_shard = sharded.state_bytes(sharded.stages[0]) - grads
    assert model_whole == _held(dtype, None)  # fp32: the weights are their own masters
    # Sharded, each replica's master chunk is a copy apart from the weights, fp32 too: 12 B
    # an element between the replicas (masters and two moments), half of it on each.
    assert model_shard == 12 * numel // 2
    held = [_held(dtype, i) for i in (0, 1)]
    padding = (len(SHAPES) + 1) * ALIGN * (4 + 8)  # elements of masters + two moments
    for mine in held:
        assert abs(mine - model_shard) <= padding, (mine, model_shard)
    assert 0 <= sum(held) - 2 * model_shard <= 2 * padding
    # One replica: nothing to shard across, the same bytes as unsharded.
    one = sharded.with_(replicas=1, placement=())
    assert one.state_bytes(one.stages[0]) == plan.state_bytes(stage)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_a_sharded_stage_reduce_scatters_then_all_gathers(dtype):
    """One stage, GPipe, two replicas on one node: the step is m forwards and backwards,
    then a reduce-scatter of the gradients as the runtime sums them (fp32: 4 bytes an
    element under bf16 too), the optimizer step over half the elements, and the all-gather
    of the new weights in their own dtype; unsharded, the all-reduce (two passes)."""
    f, b, r, m, step = 0.1, 0.2, 0.1, 4, 0.05
    n = 2_500_000  # elements: one bucket of 10 MB in fp32
    weight = 4 if dtype == "fp32" else 2
    plan = replicated(make_plan([(f, b, r)], schedule="gpipe", micro_batches=m), 2, 2)
    plan = plan.with_(
        params=(replace(plan.params[0], shape=(n,), dtype=DTYPES[dtype], bytes=n * weight),),
        stages=(replace(plan.stages[0], step_s=step),),
        model={**plan.model, "precision": dtype},
    )
    grads = 4 * n
    ring = lambda nbytes, passes: ring_s(nbytes, 2, INTRA.bandwidth, INTRA.latency_s, passes)  # noqa: E731
    whole = simulate(plan, steps=6).step_time_s
    assert whole == pytest.approx(m * (f + b) + ring(grads, 2) + step, rel=1e-9)
    shard = simulate(_sharded(plan), steps=6).step_time_s
    want = m * (f + b) + ring(grads, 1) + step / 2 + ring(n * weight, 1)
    assert shard == pytest.approx(want, rel=1e-9)
    # Bytes per replica: (d-1)/d (4 + w) N against 2 (d-1)/d 4N, as the runtime's doc says.
    said = shard_lines(_sharded(plan))[-1]
    mib = lambda x: f"{x / 2**20:.3g} MiB"  # noqa: E731
    assert said.endswith(f"{mib((4 + weight) * n / 2)} (gradients reduce-scattered, weights "
                         f"all-gathered) instead of {mib(4 * n)} (all-reduced)")  # fmt: skip


def test_a_sharded_plan_says_which_stages_shard_and_keeps_them_in_its_file(tmp_path):
    plan = replicated(make_plan([(0.1, 0.2, 0.1)] * 2), 2, 4)
    plan = _sharded(plan, on=(1,))
    lines = shard_lines(plan)
    assert lines[0].startswith("stage 1 (GPU 1) shards its masters and optimizer state across 2")
    assert len(lines) == 2
    path = tmp_path / "plan.json"
    plan.save(path)
    from ftpipe_compiler.plan import Plan

    back = Plan.load(path)
    assert [s.shard_optimizer for s in back.stages] == [False, True]
    assert shard_lines(replicated(make_plan([(0.1, 0.2, 0.1)]), 2, 2)) == []
