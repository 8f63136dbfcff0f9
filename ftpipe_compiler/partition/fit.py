"""Room left on each GPU as the plan counts it: what the partitioners' second try fits into.

The partitioners fill `Problem.memory` with their stages: the capacity less an estimate of
what the runtime holds beside them, made before any cut (a GPU exchanging messages with two
neighbours, the largest gradient, two sources' receive buffers). The plan then counts what
its cut really puts beside the stages (`costs.gpu_memory`): a GPU whose stages talk to more
GPUs holds more communicators and posted buffers (Mixed-pipe's), one that reads another's
weight (a tied embedding) holds its copy and gradient sum. Where that leaves a GPU over its
capacity, `room` says by how much its stages must shrink, and the partitioner searches again
with that GPU's budget for its own figure lowered to match (`refine.refit`, `chain.fitted`),
at most `ROUNDS` times: a new cut may move the overhead too.

    free = room(problem, plan)       # None: every GPU fits; else bytes per GPU (< 0: over)
    plan, fits = again(problem, plan, recut)   # recut(plan, free) -> a new plan, or None
"""

from __future__ import annotations

import math
from collections.abc import Callable

ROUNDS = 3  # a second cut's overhead seldom moves enough to need more


def room(problem, plan) -> list[int] | None:
    """Per GPU of `plan`: bytes its stages may still grow by (negative: must shrink by)
    before the plan's full count (`Plan.gpu_memory`) reaches the GPU's capacity, the
    fragmentation the reserve adds to every byte included. None where every GPU fits, or
    where the plan's memory is not judged at the cut (offloading or sharding: the planner
    decides those after it, as `run_partitioner` checks)."""
    if problem.offload != "none" or problem.shard_over != 1:
        return None
    free = [plan.memory_bytes - plan.gpu_memory(g) for g in range(plan.gpus)]
    if min(free) >= 0:
        return None
    grows = 1 + plan.reserve.fragmentation
    return [math.floor(f / grows) for f in free]


def again(problem, plan, recut: Callable[[object, list[int]], object]) -> tuple[object, bool]:
    """(`plan`, whether it fits), where a GPU is over by the plan's full count cut again by
    `recut(plan, free)` with each GPU's `room`, at most `ROUNDS` times; `recut` returns the
    new plan, or None where no cut fits within that room (the last plan is kept, for the
    plan's check to say where it is over)."""
    for _ in range(ROUNDS):
        free = room(problem, plan)
        if free is None:
            return plan, True
        got = recut(plan, free)
        if got is None:
            return plan, False
        plan = got
    return plan, room(problem, plan) is None
