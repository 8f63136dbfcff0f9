"""Planning for PipeDream-2BW and WPipe: the pattern a schedule needs, its memory, one model."""

from __future__ import annotations

import itertools
import random

import pytest
from partition_helpers import hardware, make_graph, make_problem

from ftpipe_compiler.costs.formulas import weight_copies
from ftpipe_compiler.errors import FtpipeError
from ftpipe_compiler.partition import PARTITIONERS, PATTERNED, build_plan, run_partitioners
from ftpipe_compiler.partition.pipedream import pipedream
from ftpipe_compiler.partition.problem import Problem


@pytest.mark.parametrize("gpus", [2, 3])
def test_wpipe_plans_put_two_stages_per_gpu_in_a_loop(seed, gpus):
    graph = make_graph(30, seed, chain=True)
    results = run_partitioners(make_problem(graph, gpus, schedule="wpipe"), progress=False)
    for r in results:
        if r.partitioner not in PATTERNED:
            assert not r.feasible and "needs them in a loop" in r.error, r.partitioner
            continue
        plan = r.plan
        assert r.feasible, r.error
        assert [(s.id, s.gpu) for s in plan.stages] == [(p, p % gpus) for p in range(2 * gpus)]
        plan.validate()
        pols = plan.policies
        assert [pols[s.id].weight_versions for s in plan.stages] == [2] * gpus + [1] * gpus
    assert {r.partitioner for r in results} == set(PARTITIONERS)


def test_a_plan_in_the_wrong_placement_is_refused_for_wpipe(seed):
    graph = make_graph(20, seed, chain=True)
    ftpipe_plan = pipedream(make_problem(graph, 2))
    with pytest.raises(FtpipeError, match="wpipe needs 4 stages placed in a loop"):
        ftpipe_plan.with_(schedule="wpipe").validate()
    with pytest.raises(FtpipeError, match="wpipe needs at least 3 micro-batches per step"):
        Problem(graph, 3, hardware(), "wpipe", micro_batches=2)


def test_looped_dp_finds_the_smallest_largest_stage(seed):
    """Cut into exactly 2P contiguous stages, the DP's largest stage is the brute-force least
    (fast links: a stage's period is its compute)."""
    rng = random.Random(seed)
    for trial in range(6):
        graph = make_graph(rng.randint(5, 9), seed + trial, chain=True)
        problem = make_problem(graph, 2, schedule="wpipe", bandwidth=1e15)
        ids = [n.id for n in graph.nodes]
        best = None
        for cuts in itertools.combinations(range(1, len(ids)), 3):
            bounds = [0, *cuts, len(ids)]
            stage_of = {ids[i]: s for s in range(4) for i in range(bounds[s], bounds[s + 1])}
            plan = build_plan(problem, stage_of, {s: s % 2 for s in range(4)}, "brute")
            worst = max(s.compute_s for s in plan.stages)
            best = worst if best is None else min(best, worst)
        got = pipedream(problem)
        assert max(s.compute_s for s in got.stages) == pytest.approx(best, rel=1e-9)


@pytest.mark.parametrize("schedule", ["2bw", "wpipe"])
def test_plans_for_2bw_and_wpipe_count_each_weight_version_once_per_copy(seed, schedule):
    graph = make_graph(24, seed, chain=True)
    gpus = 2
    problem = make_problem(graph, gpus, schedule=schedule)
    plan = pipedream(problem)
    by_name = {p.name: p for p in plan.params}
    for g in range(gpus):
        expected = 0
        held, transient = 0, 0
        for s in plan.stages_on(g):
            pol = plan.policies[s.id]
            for name in s.params:
                p = by_name[name]
                expected += p.bytes * weight_copies(pol) + (p.static_bytes - p.bytes)
            held += pol.in_flight * (s.input_bytes if pol.recompute else s.act_bytes)
            transient = max(transient, s.act_bytes if pol.recompute else 0)
        assert plan.gpu_memory_parts(g).stages == expected + held + transient
