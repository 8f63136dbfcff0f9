"""Partitioners that compete: each is a function `Problem -> Plan`, registered by name.

    results = run_partitioners(problem)                 # every partitioner, or names=[...]
    best = pick_best(results)                           # lowest period (or score=simulator)
    best.plan.save("plan.json"); best.to_json()

A partitioner that cannot fit the model raises `InfeasibleError`; `run_partitioners`
records that as an infeasible `Result` and goes on with the others. A schedule that fixes
its placement (WPipe's loop) is planned by the partitioners in `PATTERNED`, which cut a
chain into the pattern's stages; the others place stages freely and are reported as not
applicable to it.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

from tqdm import tqdm

from ..costs.formulas import PRECISIONS
from ..costs.hardware import get_hardware
from ..errors import FtpipeError, InfeasibleError, unknown
from ..plan import Plan

# Modules, not their functions: `partition.mixed` must stay the module of that name.
from . import acyclic, baselines, metis, mixed, pipedream
from .build import build_plan
from .problem import Problem

__all__ = [
    "PARTITIONERS",
    "PATTERNED",
    "Problem",
    "SPLIT",
    "Result",
    "build_plan",
    "get_partitioner",
    "pick_best",
    "problem_from_graph",
    "run_partitioner",
    "run_partitioners",
]

PARTITIONERS: dict[str, Callable[[Problem], Plan]] = {
    "mixed": mixed.mixed,
    "pipedream": pipedream.pipedream,
    "acyclic": acyclic.acyclic,
    "metis": metis.metis,
    "even-layers": baselines.even_layers,
    "params": baselines.params,
}
PATTERNED = frozenset({"pipedream", "even-layers", "params"})  # can cut a schedule's pattern
# Partitioners whose search may run in parts side by side (the searches' workers), then joined
# into the plan the search in one piece gives: name -> (part(problem, i, n) -> (its cuts,
# seconds taken), join(problem, parts) -> Plan). Mixed-pipe's cut is the longest cell of a
# search (a 16-GPU replica's: 21 s in one piece).
SPLIT = {"mixed": (mixed.part, mixed.join)}


def problem_from_graph(
    graph,
    gpus: int,
    hardware: str | None = None,
    schedule: str = "ftpipe",
    optimizer: str | None = None,
    micro_batches: int | None = None,
    seed: int = 0,
) -> Problem:
    """A Problem with the graph's defaults: its hardware, the task's optimizer, and the task's
    batch / micro-batch as micro-batches per step."""
    meta = graph.meta or {}
    if micro_batches is None:
        mb, batch = meta.get("micro_batch"), meta.get("batch")
        micro_batches = max(1, batch // mb) if mb and batch else 4
    return Problem(
        graph,
        gpus,
        get_hardware(hardware or graph.hardware or "rtx2080ti"),
        schedule,
        optimizer or meta.get("optimizer", "adamw"),
        micro_batches=micro_batches,
        seed=seed,
        precision=PRECISIONS[meta.get("precision", "fp32")],  # what the graph was traced for
        rematerialise=True,
    )


def get_partitioner(name: str) -> Callable[[Problem], Plan]:
    try:
        return PARTITIONERS[name]
    except KeyError:
        raise unknown("partitioner", name, PARTITIONERS) from None


@dataclass(frozen=True)
class Result:
    partitioner: str
    plan: Plan | None
    feasible: bool
    error: str = ""
    search_seconds: float = 0.0

    def to_json(self) -> dict:
        p = self.plan
        d = {
            "partitioner": self.partitioner,
            "feasible": self.feasible,
            "period_s": p.period_s if p else None,
            "expected_speedup": p.expected_speedup if p else None,
            "stages": len(p.stages) if p else None,
            "max_memory_bytes": p.max_memory_bytes if p else None,
            "comm_bytes": p.comm_bytes if p else None,
            "search_seconds": self.search_seconds,
        }
        if not self.feasible:
            d["error"] = self.error
        return d


def run_partitioner(problem: Problem, name: str, parts: list | None = None) -> Result:
    """One partitioner; an infeasible problem or a plan that fails its checks is a Result.
    `parts`: a `SPLIT` partitioner's parts of this problem, made already, to join.

    A plan that leaves GPUs without a stage (more GPUs than the model has useful cuts) is
    kept on the GPUs it uses: a runtime rank with nothing to run cannot take part.
    """
    fn = get_partitioner(name)
    if problem.patterned and name not in PATTERNED:
        placement = problem.sched.placement.name
        return Result(
            name,
            None,
            False,
            f"{name}: places stages freely, {problem.schedule} needs them {placement}: "
            f"use {', '.join(sorted(PATTERNED))}",
        )
    t0 = time.perf_counter()
    try:
        plan = (fn(problem) if parts is None else SPLIT[name][1](problem, parts)).compacted()
    except InfeasibleError as e:
        return Result(name, None, False, str(e), time.perf_counter() - t0)
    try:
        # Offloading, what a GPU holds depends on what its stages offload, which the planner
        # chooses after the cut (planner/offload.py); the simulation then judges the memory.
        # Sharding across replicas likewise, after the plan is replicated (planner/search.py).
        plan.validate(memory=problem.offload == "none" and problem.shard_over == 1)
    except FtpipeError as e:
        return Result(name, plan, False, f"{name}: {e}", plan.search_seconds)
    return Result(name, plan, True, "", plan.search_seconds)


def run_partitioners(problem: Problem, names=None, progress: bool = True) -> list[Result]:
    names = list(PARTITIONERS) if names is None else list(names)
    for n in names:
        get_partitioner(n)  # unknown names fail before any work
    out = []
    bar = tqdm(
        names,
        desc="partitioning",
        file=sys.stderr,
        disable=None if progress else True,  # None: only on a terminal
        leave=False,
    )
    for n in bar:
        bar.set_postfix_str(n)
        out.append(run_partitioner(problem, n))
    return out


def pick_best(results: list[Result], score: Callable[[Plan], float] | None = None) -> Result:
    """The feasible result with the lowest score (default: period), then fewer bytes, then name."""
    score = score or (lambda plan: plan.period_s)
    ok = [r for r in results if r.feasible]
    if not ok:
        why = "; ".join(r.error for r in results if r.error) or "no partitioner ran"
        raise InfeasibleError(f"no partitioner found a plan that fits: {why}")
    return min(ok, key=lambda r: (score(r.plan), r.plan.comm_bytes, r.partitioner))
