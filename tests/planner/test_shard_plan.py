"""The planner's choice to shard a stage's optimizer state across its replicas (ZeRO-1,
`planner/offload.py`): only with replicas, only where a GPU needs it, before any offload;
never where the runtime refuses it; `ftpipe compile --shard-optimizer`."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
from click.testing import CliRunner

from ftpipe_compiler.cli import cli
from ftpipe_compiler.costs.cluster import get_cluster
from ftpipe_compiler.costs.formulas import MemoryReserve
from ftpipe_compiler.errors import InfeasibleError
from ftpipe_compiler.partition import problem_from_graph, run_partitioner
from ftpipe_compiler.plan import Plan
from ftpipe_compiler.planner import Space, placement, plan_shape
from ftpipe_compiler.planner.offload import choose_offload, shard_refusal


@pytest.fixture(scope="module")
def problem(tiny_t5_costed):
    p = problem_from_graph(tiny_t5_costed, 2, "rtx2080ti", "1f1b", "adamw", 4)
    return replace(p, hardware=replace(p.hardware, memory_reserve=MemoryReserve()))


@pytest.fixture(scope="module")
def pair(problem):
    """The 2-GPU plan in 4 replicas, and its GPUs' needs whole and every stage sharded. (In
    fp32 two replicas free nothing at the peak: each keeps its whole fp32 gradient sums and
    the reduce-scatter's flat copy and chunk, 4 + 4 + 2 B an element, beside 6 B of masters
    and AdamW state, where unsharded it keeps 4 + 4 + 8; four keep 4 + 4 + 1 + 3.)"""
    plan = run_partitioner(problem, "pipedream").plan
    plan = plan.with_(replicas=4, placement=placement(4, plan.gpus, "pipeline"))
    every = plan.with_(stages=tuple(replace(s, shard_optimizer=True) for s in plan.stages))
    whole = {g: plan.gpu_memory(g) for g in range(plan.gpus)}
    sharded = {g: every.gpu_memory(g) for g in range(plan.gpus)}
    return plan, whole, sharded


def test_replicas_shard_where_a_gpu_needs_it_and_offload_nothing(pair):
    plan, whole, sharded = pair
    full = max(whole, key=whole.get)
    assert sharded[full] < whole[full]
    tight = plan.with_(memory_bytes=(sharded[full] + whole[full]) // 2)
    assert not tight.feasible
    for mode in ("auto", "none"):  # sharding first even where offload may follow
        chosen = choose_offload(tight, mode)
        assert chosen.feasible
        assert not any(s.offload.any for s in chosen.stages)
        assert any(s.shard_optimizer for s in chosen.stages_on(full))
        assert chosen.model["shard_optimizer"] == "auto"
        # Only what the GPU needed: unsharding any one stage overflows its GPU again.
        for s in chosen.stages:
            if s.shard_optimizer:
                undone = chosen.with_(
                    stages=tuple(
                        replace(x, shard_optimizer=False) if x.id == s.id else x
                        for x in chosen.stages
                    )
                )
                assert undone.gpu_memory(s.gpu) > tight.memory_bytes
    # A plan that fits shards nothing; --shard-optimizer none never, always every stage.
    assert not any(s.shard_optimizer for s in choose_offload(plan, "auto").stages)
    assert not any(s.shard_optimizer for s in choose_offload(tight, "auto", "none").stages)
    trains = [bool(s.params) for s in plan.stages]
    assert [s.shard_optimizer for s in choose_offload(plan, "none", "always").stages] == trains


def test_one_replica_never_shards(pair):
    """With one replica there is nothing to shard across: a GPU over its memory offloads."""
    plan, whole, _ = pair
    one = plan.with_(replicas=1, placement=())
    full = max(whole, key=whole.get)
    tight = one.with_(memory_bytes=one.gpu_memory(full) * 9 // 10)
    for shard in ("auto", "always"):
        chosen = choose_offload(tight, "auto", shard)
        assert not any(s.shard_optimizer for s in chosen.stages)
        assert any(s.offload.any for s in chosen.stages)
    assert choose_offload(one, "none", "always") is one


def test_what_the_runtime_refuses_is_never_planned():
    assert shard_refusal("adamw") is None and shard_refusal("SGD") is None
    assert "adafactor" in shard_refusal("adafactor")
    assert "--freeze-training" in shard_refusal("adamw", freezing=True)
    assert Space(batch=8, optimizer="adafactor", shard="always").sharding == "none"
    assert Space(batch=8, shard="auto").sharding == "auto"
    assert Space(batch=8).sharding == "none"  # asked for only by `ftpipe compile`


def test_the_cluster_planner_shards_a_shape_that_fits_only_so(problem, pair):
    """4 replicas x 2 GPUs with each GPU's memory between its sharded and whole needs: the
    planner finds the plan by sharding; without sharding no shape fits."""
    plan, whole, sharded = pair
    memory = (max(sharded.values()) + max(whole.values())) // 2
    hw = replace(problem.hardware, memory_bytes=memory)
    cluster = get_cluster("rtx2080ti", 8, 2)
    graph = problem.graph
    space = Space(batch=16, replicas=4, partitioners=("pipedream",), steps=4, workers=1,
                  schedules=("1f1b",), micro_batches=4,
                  micro_batch_sizes=(int(graph.meta.get("micro_batch", 1)),))  # fmt: skip
    found = plan_shape(lambda b: graph, cluster, replace(space, shard="auto"), hw, False)
    assert (found.plan.replicas, found.plan.gpus) == (4, 2)
    assert found.sim.fits
    assert any(s.shard_optimizer for s in found.plan.stages)
    assert not any(s.offload.any for s in found.plan.stages)
    with pytest.raises(InfeasibleError):
        plan_shape(lambda b: graph, cluster, space, hw, False)


BASE = ["compile", "--model", "t5-tiny", "--hardware", "cpu", "--batch", "16"]


def test_compile_shards_every_stage_when_told_and_says_so(tmp_path):
    out = tmp_path / "out"
    argv = [*BASE, "--gpus", "4", "--replicas", "2", "--shard-optimizer", "always"]
    argv += ["--optimizer", "adamw"]  # the task's own is Adafactor
    r = CliRunner().invoke(cli, [*argv, "-o", str(out)])
    assert r.exit_code == 0, r.output
    plan = Plan.load(out / "plan.json")
    assert plan.replicas == 2
    assert all(s.shard_optimizer for s in plan.stages if s.params)
    assert "shards its masters and optimizer state across 2 replicas" in r.output
    assert "--shard-optimizer always" in r.output
    raw = json.loads((out / "plan.json").read_text())
    assert any(st["shard_optimizer"] for st in raw["stages"])  # what the runtime reads
    readme = next(out.glob("*/README.md")).read_text()
    assert "across its 2 replicas" in readme


@pytest.mark.parametrize(
    ("extra", "said"),
    [
        (["--gpus", "2"], "give --replicas"),
        (["--gpus", "4", "--replicas", "2", "--freeze-training", "0.5"], "freezes layers"),
        (["--gpus", "4", "--replicas", "2"], "adafactor keeps its state per matrix"),
    ],
)
def test_compile_refuses_sharding_it_cannot_plan(tmp_path, extra, said):
    argv = [*BASE, *extra, "--shard-optimizer", "always", "-o", str(tmp_path / "o")]
    r = CliRunner().invoke(cli, argv)
    assert r.exit_code == 2 and said in r.output, r.output
