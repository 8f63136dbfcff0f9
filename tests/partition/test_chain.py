"""PipeDream's DP against brute force over every contiguous split (FTPipe eq. 1, exact plans)."""

from __future__ import annotations

import itertools
import random

import pytest
from partition_helpers import make_graph, make_problem

from ftpipe_compiler.errors import InfeasibleError
from ftpipe_compiler.partition import build_plan
from ftpipe_compiler.partition.baselines import even_layers, layer_units, params
from ftpipe_compiler.partition.chain import compress
from ftpipe_compiler.partition.indexed import NodeCosts
from ftpipe_compiler.partition.pipedream import pipedream


def brute_force(problem, score=lambda plan: plan.period_s, exact_stages=None):
    """Best feasible contiguous split of the graph order into at most P stages (one per GPU),
    feasible as the partitioners count it: the stages' memory within `problem.memory` (the
    plan adds the runtime's buffers, which no partitioner sees)."""
    ids = [n.id for n in problem.graph.nodes]
    best = None
    counts = [exact_stages] if exact_stages else range(1, problem.gpus + 1)
    for m in counts:
        for cuts in itertools.combinations(range(1, len(ids)), m - 1):
            bounds = [0, *cuts, len(ids)]
            stage_of = {ids[i]: s for s in range(m) for i in range(bounds[s], bounds[s + 1])}
            plan = build_plan(problem, stage_of, {s: s for s in range(m)}, "brute")
            fits = all(plan.gpu_memory_parts(g).stages <= problem.memory for g in range(m))
            if fits and (best is None or score(plan) < score(best)):
                best = plan
    return best


def test_dp_equals_brute_force_on_chains_with_transfers_and_memory(seed):
    rng = random.Random(seed)
    checked_tight = 0
    for trial in range(12):
        graph = make_graph(rng.randint(4, 9), seed + trial, chain=True)
        loose = make_problem(graph, gpus=rng.randint(1, 4), bandwidth=rng.choice([1e5, 1e6, 1e9]))
        # Room for the stages between the best loose plan's peak and the single-GPU peak (the
        # GPU's capacity holds a backward's largest gradient and receive buffers besides).
        single = brute_force(make_problem(graph, 1)).gpu_memory_parts(0).stages
        limit = rng.randint(single // 3, single)
        beside = loose.capacity - loose.memory
        problem = make_problem(graph, loose.gpus, limit + beside, bandwidth=loose.bandwidth)
        assert problem.memory == limit
        want = brute_force(problem)
        if want is None:
            with pytest.raises(InfeasibleError, match="infeasible: needs"):
                pipedream(problem)
            continue
        checked_tight += limit < single
        got = pipedream(problem)
        got.validate(memory=False)  # the stages fit; the runtime's buffers are not its to see
        assert got.period_s == pytest.approx(want.period_s, rel=1e-9)
    assert checked_tight  # memory actually constrained some cases


def test_dp_equals_brute_force_on_random_dags(seed):
    """Compute-bound (fast links): the DP is exact for contiguous splits of any DAG."""
    rng = random.Random(seed)
    for trial in range(10):
        graph = make_graph(rng.randint(4, 9), seed + 100 + trial)
        problem = make_problem(graph, gpus=rng.randint(2, 4), bandwidth=1e15)
        want = brute_force(problem)
        got = pipedream(problem)
        assert got.period_s == pytest.approx(want.period_s, rel=1e-9)


def test_params_baseline_is_the_best_parameter_balance(seed):
    graph = make_graph(8, seed, chain=True)
    problem = make_problem(graph, gpus=3)
    static = lambda plan: max(  # noqa: E731
        sum(
            p.static_bytes for p in plan.params if set(p.stages) & {s.id for s in plan.stages_on(g)}
        )
        for g in range(plan.gpus)
    )
    want = brute_force(problem, score=static, exact_stages=3)
    assert static(params(problem)) == static(want)


def test_even_layers_puts_an_equal_number_of_layers_on_every_gpu(seed):
    problem = make_problem(make_graph(12, seed), gpus=4)
    plan = even_layers(problem)
    assert sorted(len(s.nodes) for s in plan.stages) == [3, 3, 3, 3]
    uneven = even_layers(make_problem(make_graph(10, seed), gpus=4))
    assert sorted(len(s.nodes) for s in uneven.stages) == [2, 2, 3, 3]


def test_compression_keeps_order_and_every_node(seed):
    problem = make_problem(make_graph(60, seed), gpus=2)
    costs = NodeCosts.of(problem)
    units = compress(costs, [[i] for i in range(costs.n)], 10)
    assert [i for u in units for i in u] == list(range(costs.n))
    assert len(units) <= 2 * 10 + 1
    assert layer_units(costs) == [[i] for i in range(costs.n)]  # every node is its own layer here
