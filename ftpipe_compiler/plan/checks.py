"""Is a plan one that can run? `Plan.validate` asks here; each check raises FtpipeError
naming the first thing wrong, in the order a reader would look: the plan's sizes, its
stages, the stage graph, the schedule, where the ranks go, and (optionally) memory.

Kept apart from the dataclasses in plan.py: those say what a plan is, this says what a
runnable one must satisfy.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import networkx as nx
from ftpipe_runtime.schedules import SCHEDULES, ScheduleError, resolve_schedule

from ..costs.host import host_memory
from ..errors import FtpipeError, unknown

if TYPE_CHECKING:  # plan.py imports this module; the type is only for reading
    from .plan import Plan

__all__ = ["check_plan"]


def check_plan(plan: Plan, *, memory: bool = True) -> None:
    _check_sizes(plan)
    _check_stages(plan)
    _check_stage_graph(plan)
    try:
        resolve_schedule(plan.schedule, plan.recompute).check(
            plan.stage_infos(), plan.micro_batches
        )
    except ScheduleError as e:
        raise FtpipeError(str(e)) from None
    _check_placement(plan)
    if memory:
        _check_memory(plan)


def _check_sizes(plan: Plan) -> None:
    if plan.schedule not in SCHEDULES:
        raise unknown("schedule", plan.schedule, SCHEDULES)
    if plan.gpus < 1 or plan.micro_batches < 1 or plan.bandwidth <= 0:
        raise FtpipeError("gpus and micro_batches must be at least 1 and bandwidth positive")
    if [s.id for s in plan.stages] != list(range(len(plan.stages))) or not plan.stages:
        raise FtpipeError("stages must be numbered 0, 1, 2, ... in order")
    if not 0 <= plan.loss_stage < len(plan.stages):
        raise FtpipeError(f"the loss stage {plan.loss_stage} is not a stage of the plan")


def _check_stages(plan: Plan) -> None:
    seen: set[str] = set()
    for s in plan.stages:
        dup = seen.intersection(s.nodes)
        if dup:
            raise FtpipeError(f"nodes {sorted(dup)[:3]} are in two stages")
        seen.update(s.nodes)
        if not 0 <= s.gpu < plan.gpus:
            raise FtpipeError(f"stage {s.id} is on GPU {s.gpu}, outside 0..{plan.gpus - 1}")
        if not all(math.isfinite(x) and x >= 0 for x in (s.fwd_s, s.bwd_s, s.recompute_s)):
            raise FtpipeError(f"stage {s.id} has a negative or non-finite time")
        if not 0 <= s.wgrad_s <= s.bwd_s * (1 + 1e-9):
            raise FtpipeError(
                f"stage {s.id}: its weight-gradient time {s.wgrad_s} is not part of its "
                f"backward time {s.bwd_s}"
            )


def _check_stage_graph(plan: Plan) -> None:
    """Transfers and parameters between existing stages, forwards only, no cycle, and each
    GPU's stages in topological order."""
    g = nx.DiGraph()
    g.add_nodes_from(s.id for s in plan.stages)
    for t in plan.transfers:
        if not {t.producer, *t.consumers} <= set(g):
            raise FtpipeError(f"transfer {t.tensor} names a stage the plan does not have")
        for c in t.consumers:
            if c <= t.producer:
                raise FtpipeError(f"stage {c} receives from a later stage {t.producer}")
            g.add_edge(t.producer, c)
    if any(not set(p.stages) <= set(g) for p in plan.params):
        raise FtpipeError("a parameter is owned by a stage the plan does not have")
    if not nx.is_directed_acyclic_graph(g):
        raise FtpipeError("the stage graph has a cycle")
    for gpu in range(plan.gpus):
        ids = [s.id for s in plan.stages_on(gpu)]
        if ids != sorted(ids):
            raise FtpipeError(f"stages on GPU {gpu} are not in topological order")


def _check_placement(plan: Plan) -> None:
    if plan.replicas < 1:
        raise FtpipeError(f"a plan needs at least 1 replica, not {plan.replicas}")
    want = sorted((r, g) for r in range(plan.replicas) for g in range(plan.gpus))
    if sorted(plan.placed()) != want:
        raise FtpipeError(
            f"the placement must give each of the {plan.replicas} replicas' {plan.gpus} GPUs "
            "one rank"
        )
    if plan.cluster is not None and plan.cluster.gpus != plan.world:
        raise FtpipeError(
            f"the plan runs on {plan.world} GPUs but its cluster has {plan.cluster.gpus}"
        )


def _check_memory(plan: Plan) -> None:
    over = [g for g in range(plan.gpus) if plan.gpu_memory(g) > plan.memory_bytes]
    if over:
        raise FtpipeError(
            f"GPU {over[0]} needs {plan.gpu_memory(over[0]) / 2**30:.1f} GiB, more than its "
            f"{plan.memory_bytes / 2**30:.1f} GiB"
        )
    if not plan.host_fits:
        node, held = max(host_memory(plan).items(), key=lambda kv: kv[1])
        raise FtpipeError(
            f"node {node}'s host needs {held / 2**30:.1f} GiB for what its stages offload, more "
            f"than its {plan.host.memory_bytes / 2**30:.1f} GiB"
        )
