"""The planner's step floor against brute force: no plan of a small model, whatever its cut and
placement, simulates a step below it, under every schedule; under a synchronous one with
fewer micro-batches than GPUs the round trip is what binds."""

from __future__ import annotations

from itertools import combinations

import pytest

from ftpipe_compiler.errors import FtpipeError
from ftpipe_compiler.partition import PARTITIONERS, build_plan, problem_from_graph, run_partitioner
from ftpipe_compiler.partition.chain import compress
from ftpipe_compiler.partition.indexed import NodeCosts
from ftpipe_compiler.planner.bounds import round_trip_s, step_floor
from ftpipe_compiler.planner.matrix import schedule_names
from ftpipe_compiler.simulate import simulate

GPUS, UNITS = 4, 9


def _plans(problem):
    """Every contiguous cut of the chain into its stages (one per GPU, and folded two per
    GPU; a schedule with a placement pattern: placed by it), and every partitioner's plan."""
    costs = NodeCosts.of(problem)
    units = compress(costs, [[i] for i in range(costs.n)], UNITS)
    ids, n = costs.ids, problem.chain_length
    if problem.patterned:
        placings = [{s.id: s.gpu for s in problem.sched.placement.chain(problem.gpus)}]
    else:
        placings = [{s: s for s in range(n)}, {s: s % (n // 2) for s in range(n)}]
    for cuts in combinations(range(1, len(units)), n - 1):
        bounds = [0, *cuts, len(units)]
        stage_of = {
            ids[i]: s for s in range(n) for u in units[bounds[s] : bounds[s + 1]] for i in u
        }
        for gpu_of in placings:
            yield build_plan(problem, stage_of, gpu_of, "cut")
    for p in PARTITIONERS:
        result = run_partitioner(problem, p)
        if result.feasible:
            yield result.plan


def _problem(graph, schedule):
    """The fewest micro-batches the schedule runs on GPUS GPUs: a pipeline mostly filling
    and draining."""
    for m in range(1, GPUS + 1):
        try:
            return problem_from_graph(graph, GPUS, "rtx2080ti", schedule, "adamw", m)
        except FtpipeError:
            continue
    raise AssertionError(f"{schedule} runs no micro-batch count up to {GPUS}")


@pytest.mark.parametrize("schedule", schedule_names("auto"))
def test_no_plan_steps_below_the_floor(tiny_t5_costed, schedule):
    problem = _problem(tiny_t5_costed, schedule)
    floor = step_floor(problem)
    compute = problem.micro_batches * problem.lower_bound()
    if problem.sched.synchronous:
        assert floor == max(compute, round_trip_s(problem))
        if problem.micro_batches == 1:  # one micro-batch: its round trip is the step
            assert round_trip_s(problem) > compute
    else:  # no flush: a pipeline that never drains, only its compute bounds it
        assert floor == compute
    steps = []
    for plan in _plans(problem):
        try:
            sim = simulate(plan, steps=4)
        except FtpipeError:  # a placement this schedule refuses
            continue
        steps.append(sim.step_time_s)
        assert sim.step_time_s >= floor * (1 - 1e-9), (schedule, [s.gpu for s in plan.stages])
    assert len(steps) >= 10
