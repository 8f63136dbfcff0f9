"""Synthetic plans with chosen stage costs, built directly (no tracing), for the simulator
(a module of its own, not conftest: `from conftest import` would find another folder's)."""

from __future__ import annotations

import pytest

from ftpipe_compiler.costs.hardware import get_hardware
from ftpipe_compiler.partition import build_plan
from ftpipe_compiler.partition.problem import Problem
from ftpipe_compiler.plan import Plan, PlanParam, Stage, Transfer


def make_plan(
    costs,
    gpu_of=None,
    nbytes=0,
    bandwidth=1e9,
    schedule="ftpipe",
    micro_batches=4,
    edges=None,
    tied=(),
    tied_bytes=4000,
    memory_bytes=10**6,
):
    """Stages with (fwd, bwd, recompute) seconds; `edges`: {producer: consumers} (default a
    chain), one transfer of `nbytes` per producer; `tied`: stage sets sharing a parameter of
    `tied_bytes`, owned by the lowest and sent to the others as build_plan does."""
    k = len(costs)
    gpu_of = list(gpu_of or range(k))
    edges = edges if edges is not None else {i: [i + 1] for i in range(k - 1)}
    tied_names = {f"tied{j}": tuple(sorted(ss)) for j, ss in enumerate(tied)}
    after = {i: set(edges.get(i, ())) for i in range(k)}
    for ss in tied_names.values():
        after[ss[0]].update(ss[1:])
    depth = {}
    for i in reversed(range(k)):
        depth[i] = max((depth[j] + 1 for j in after[i]), default=0)
    stages = tuple(
        Stage(
            id=i,
            gpu=gpu_of[i],
            nodes=(f"n{i}",),
            fwd_s=f,
            bwd_s=b,
            recompute_s=r,
            recompute=i != k - 1,
            depth=depth[i],
            params=(f"w{i}", *(t for t, ss in tied_names.items() if i == ss[0])),
            inputs=(
                *(f"n{p}" for p, cs in edges.items() if i in cs),
                *(t for t, ss in tied_names.items() if i in ss[1:]),
            ),
            outputs=(
                *((f"n{i}",) if edges.get(i) else ()),
                *(t for t, ss in tied_names.items() if i == ss[0]),
            ),
            model_inputs=("x",) if i == 0 else (),
            input_bytes=100 * (i + 1),
            act_bytes=1000 * (i + 1),
        )
        for i, (f, b, r) in enumerate(costs)
    )
    transfers = tuple(
        Transfer(f"n{p}", p, tuple(cs), (1,), "float32", nbytes, True)
        for p, cs in sorted(edges.items())
        if cs
    ) + tuple(
        Transfer(t, ss[0], ss[1:], (1,), "float32", tied_bytes, True)
        for t, ss in tied_names.items()
    )
    params = tuple(PlanParam(f"w{i}", (1,), "float32", 4, 10_000, True, (), (i,)) for i in range(k))
    params += tuple(
        PlanParam(t, (1,), "float32", tied_bytes, 3 * tied_bytes, True, (), ss[:1])
        for t, ss in tied_names.items()
    )
    return Plan(
        partitioner="test",
        gpus=max(gpu_of) + 1,
        schedule=schedule,
        micro_batches=micro_batches,
        optimizer="sgd",
        bandwidth=bandwidth,
        memory_bytes=memory_bytes,
        stages=stages,
        transfers=transfers,
        params=params,
        loss_stage=k - 1,
        model={"spec": "synthetic", "micro_batch": 2},
        competitors=({"partitioner": "test", "period_s": 1.5, "speedup": 3.2},),
    )


@pytest.fixture
def plan_factory():
    return make_plan


def contiguous_plan(
    graph, stages, gpu_of, schedule="ftpipe", micro_batches=4, hardware="rtx2080ti"
):
    """Cut the node order into `stages` chunks of equal work; stage i on GPU gpu_of[i]."""
    problem = Problem(
        graph,
        max(gpu_of) + 1,
        get_hardware(hardware),
        schedule,
        "adafactor",
        micro_batches=micro_batches,
    )
    work = problem.work_recompute
    total, done, stage_of = sum(work.values()), 0.0, {}
    for n in graph.nodes:
        stage_of[n.id] = min(stages - 1, int(done / total * stages))
        done += work[n.id]
    return build_plan(problem, stage_of, dict(enumerate(gpu_of)), "contiguous")


@pytest.fixture
def contiguous():
    return contiguous_plan
