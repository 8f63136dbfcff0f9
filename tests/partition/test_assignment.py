"""The incremental Assignment must agree with build_plan's Plan to the byte and the second."""

from __future__ import annotations

import random

import pytest
from partition_helpers import make_graph, make_problem

from ftpipe_compiler.partition import build_plan
from ftpipe_compiler.partition.assignment import Assignment
from ftpipe_compiler.partition.indexed import NodeCosts
from ftpipe_compiler.partition.refine import refine


def random_assignment(costs: NodeCosts, rng: random.Random, gpus: int) -> Assignment:
    """Slices of the graph order (always acyclic), several stages per GPU at random."""
    n = costs.n
    cuts = sorted(rng.sample(range(1, n), rng.randint(0, min(6, n - 1))))
    stage_of, s = [], 0
    for i in range(n):
        if s < len(cuts) and i == cuts[s]:
            s += 1
        stage_of.append(s)
    gpu_of = [rng.randrange(gpus) for _ in range(len(cuts) + 1)]
    return Assignment(costs, stage_of, gpu_of)


def random_legal_moves(lay: Assignment, rng: random.Random, count: int) -> None:
    for _ in range(count):
        i = rng.randrange(lay.c.n)
        lo = max((lay.stage[p] for p in lay.c.preds[i]), default=0)
        hi = min((lay.stage[q] for q in lay.c.succs[i]), default=lay.nstages - 1)
        lay.move([i], rng.randint(lo, hi))


def assert_same_as_plan(lay: Assignment, problem) -> None:
    plan = build_plan(problem, lay.stage_of(), lay.gpu_of(), "test")
    if plan.feasible:
        plan.validate()
    for g in range(problem.gpus):
        assert lay.gpu_period(g) == pytest.approx(plan.gpu_period_s(g), rel=1e-9, abs=1e-15)
        assert lay.memory(g) == plan.gpu_memory_parts(g).stages  # the runtime's buffers aside
    assert lay.comm_bytes() == plan.comm_bytes
    assert lay.period() == pytest.approx(plan.period_s, rel=1e-9)


@pytest.mark.parametrize("schedule", ["ftpipe", "gpipe", "1f1b", "2bw"])
def test_assignment_matches_plan_after_random_moves(seed, schedule):
    rng = random.Random(seed)
    for trial in range(8):
        problem = make_problem(
            make_graph(rng.randint(5, 40), seed + trial, loss=rng.choice([-1, -2, 0])),
            gpus=rng.randint(1, 4),
            schedule=schedule,
        )
        lay = random_assignment(NodeCosts.of(problem), rng, problem.gpus)
        assert_same_as_plan(lay, problem)
        random_legal_moves(lay, rng, 30)
        assert_same_as_plan(lay, problem)


def test_undo_restores_every_figure(seed):
    rng = random.Random(seed)
    problem = make_problem(make_graph(30, seed), gpus=3)
    lay = random_assignment(NodeCosts.of(problem), rng, 3)
    before = (lay.periods(), [lay.memory(g) for g in range(3)], lay.comm_bytes(), list(lay.stage))
    nodes = [5, 6, 7]
    moved = lay.move(nodes, 0)
    lay.undo(nodes, moved)
    after = (lay.periods(), [lay.memory(g) for g in range(3)], lay.comm_bytes(), list(lay.stage))
    assert after[1:] == before[1:]
    assert after[0] == pytest.approx(before[0])


def test_refine_never_raises_the_period_and_keeps_the_plan_valid(seed):
    rng = random.Random(seed)
    for trial in range(6):
        problem = make_problem(make_graph(40, seed + trial), gpus=3)
        costs = NodeCosts.of(problem)
        lay = random_assignment(costs, rng, 3)
        start = lay.period()
        refine(lay, [[i] for i in range(costs.n)])
        assert lay.period() <= start * (1 + 1e-12)
        plan = build_plan(problem, lay.stage_of(), lay.gpu_of(), "test")
        plan.validate()
        assert plan.period_s == pytest.approx(lay.period())


def _books(lay: Assignment) -> dict:
    """Every count an Assignment keeps (zero counts are as good as absent)."""

    def nonzero(dicts):
        return [{k: v for k, v in d.items() if v} for d in dicts]

    return {
        "stage": list(lay.stage),
        "size": list(lay.size),
        "act": list(lay.act),
        "input_bytes": list(lay.input_bytes),
        "owned": (list(lay.trainable), list(lay.frozen), list(lay.state)),
        "traffic": (list(lay.fwd), list(lay.bwd)),
        "edges": nonzero(lay.out_edges),
        "depth": (lay._epoch_now(), list(lay.depth))[1],  # where kept, as made afresh
        "readers": [
            nonzero(d)
            for d in (lay.stage_readers, lay.gpu_readers, lay.input_readers, lay.param_readers)
        ],
    }


def test_a_fresh_assignment_keeps_the_books_moves_keep(seed):
    """Built in one pass, an assignment holds what moving its nodes in leaves: one built
    on other cuts of the graph order (as many stages, on the same GPUs) and moved node by
    node onto these cuts keeps the same counts."""
    rng = random.Random(seed)
    for trial in range(8):
        problem = make_problem(make_graph(rng.randint(8, 40), seed + trial), gpus=3)
        costs = NodeCosts.of(problem)
        stages = rng.randint(1, 6)
        cuts = [sorted(rng.sample(range(1, costs.n), stages - 1)) for _ in range(2)]
        there, here = ([sum(i >= c for c in cut) for i in range(costs.n)] for cut in cuts)
        gpu_of = [rng.randrange(3) for _ in range(stages)]
        lay, fresh = Assignment(costs, there, gpu_of), Assignment(costs, here, gpu_of)
        for i in range(costs.n):
            lay.move([i], here[i])
        assert _books(lay) == _books(fresh)
        assert lay.rec == pytest.approx(fresh.rec) and lay.last == pytest.approx(fresh.last)
        assert lay.periods() == pytest.approx(fresh.periods())
        assert [lay.memory(g) for g in range(3)] == [fresh.memory(g) for g in range(3)]
