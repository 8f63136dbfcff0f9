"""The partition and the schedule chosen together: every partitioner under every schedule,
each plan simulated, and the fastest that fits wins.

    winner, matrix = search_matrix(problem, schedules=["1f1b", "zb1p", "zbv"])
    winner.plan, winner.sim              # the winning plan (for its schedule), its simulation
    [cell.to_json() for cell in matrix]  # one row per (schedule, partitioner)
    schedule_names("sync")               # the schedules whose update is plain mini-batch SGD

`problem` says everything but the schedule (its own is ignored): the graph, GPUs, hardware,
optimizer, micro-batches, memory. A schedule changes what each stage keeps (memory), which
stages recompute (time) and, for interleaved, ZB-V and WPipe, where stages sit (only the
partitioners that cut a chain can make those patterns); so each (schedule, partitioner) is
its own partitioning problem, its own plan and its own simulation.

Search order and pruning, so that the matrix stays within the compile budget:
1. The cheap partitioners (even-layers, params, pipedream: a second or less each, even on T5-3B)
   run under every schedule.
2. The others (mixed, acyclic, METIS: seconds to tens of seconds each on T5-3B) run under
   the `width` free-placement schedules whose cheap plans simulate fastest (schedules
   without a cheap plan that fits rank last; every schedule when no cheap partitioner is
   selected; under a schedule with a placement pattern they say n/a at once). Cells left
   out are marked "not searched" with the figure that ranked their schedule out.
3. No plan under a schedule simulates a step faster than m x its lower bound on the period
   (`Problem.lower_bound`: every GPU computes its share of m micro-batches per step); a cell
   whose bound is not below the best step found so far is skipped, marked "pruned" with
   both figures.
The matrix keeps every cell: figures, or why it has none (not applicable, infeasible, does
not fit, not searched, pruned). The search is deterministic: no time budget, only counts.
"""

from __future__ import annotations

import math
import sys
import time
from dataclasses import dataclass, replace

from ftpipe_runtime.schedules import SCHEDULES, StageInfo, get_schedule
from tqdm import tqdm

from ..errors import FtpipeError, InfeasibleError, unknown
from ..partition import PARTITIONERS, PATTERNED, Problem, run_partitioner
from ..plan import Plan
from ..simulate import SimResult, simulate

__all__ = ["CHEAP", "GROUPS", "Cell", "search_matrix", "evaluate", "schedule_names", "update_rule"]

CHEAP = ("even-layers", "params", "pipedream")  # a second or less each, even on T5-3B
GROUPS = {
    "auto": "every schedule",
    "sync": "the schedules whose update is one-process mini-batch SGD",
}


def update_rule(name: str) -> str:
    """ "sync" when every stage's update is plain mini-batch SGD (weights of step k-1 for
    step k), "stale" when some stage trains on older weights (2BW, WPipe, FTPipe)."""
    sched = get_schedule(name)
    free = sched.placement.free
    stages = [StageInfo(0, 0, 1, False), StageInfo(1, 1, 0, True)]
    policies = sched.policies(stages if free else sched.placement.chain(2), 4)
    return "sync" if {p.weight_delay for p in policies.values()} == {0} else "stale"


def schedule_names(spec: str) -> list[str]:
    """`auto`, `sync`, or a comma-separated list of schedule names, as a list of names."""
    if spec == "auto":
        return list(SCHEDULES)
    if spec == "sync":
        return [n for n in SCHEDULES if update_rule(n) == "sync"]
    names = [n.strip() for n in spec.split(",") if n.strip()]
    for n in names:
        if n not in SCHEDULES:
            raise unknown("schedule", n, [*GROUPS, *SCHEDULES])
    if not names:
        raise FtpipeError("no schedule named; give auto, sync or a list such as 1f1b,zb1p")
    return names


@dataclass(frozen=True)
class Cell:
    """One (schedule, partitioner) of the matrix."""

    schedule: str
    partitioner: str
    status: str  # ok | does not fit | infeasible | n/a | not searched | pruned
    bound_s: float = math.nan  # lower bound on the step time under this schedule
    plan: Plan | None = None
    sim: SimResult | None = None
    search_s: float = 0.0
    note: str = ""

    @property
    def step_s(self) -> float:
        return self.sim.step_time_s if self.sim is not None else math.inf

    def to_json(self) -> dict:
        p, s = self.plan, self.sim
        return {
            "schedule": self.schedule,
            "update": update_rule(self.schedule),
            "partitioner": self.partitioner,
            "status": self.status,
            "stages": len(p.stages) if p else None,
            "period_s": p.period_s if p else None,
            "simulated_step_time_s": s.step_time_s if s else None,
            "simulated_samples_per_s": s.samples_per_s if s else None,
            "bubble_fraction": s.bubble_fraction if s else None,
            "max_memory_bytes": s.max_memory_bytes if s else None,
            "step_lower_bound_s": None if math.isnan(self.bound_s) else self.bound_s,
            "search_seconds": self.search_s,
            "note": self.note,
        }


def search_matrix(
    problem: Problem,
    schedules: list[str] | None = None,
    partitioners: list[str] | None = None,
    *,
    steps: int = 20,
    width: int = 1,
    progress: bool = True,
) -> tuple[Cell, list[Cell]]:
    """(the fastest cell whose plan fits, every cell in schedule x partitioner order)."""
    schedules = list(SCHEDULES) if schedules is None else list(schedules)
    names = list(PARTITIONERS) if partitioners is None else list(partitioners)
    for n in names:
        if n not in PARTITIONERS:
            raise unknown("partitioner", n, PARTITIONERS)
    cells: dict[tuple[str, str], Cell] = {}
    problems, bound = _per_schedule(problem, schedules, names, cells)
    cheap = [p for p in names if p in CHEAP]
    costly = [p for p in names if p not in CHEAP]
    bar = tqdm(
        total=len(problems) * len(names),
        desc="plans",
        file=sys.stderr,
        disable=None if progress else True,
        leave=False,
    )
    best = [math.inf]

    def visit(s: str, p: str) -> None:
        bar.set_postfix_str(f"{p} / {s}")
        bar.update()
        if bound[s] >= best[0]:
            note = f"step >= {bound[s]:.4g} s, not below the best {best[0]:.4g} s"
            cells[(s, p)] = Cell(s, p, "pruned", bound[s], note=note)
            return
        cells[(s, p)] = cell = evaluate(problems[s], p, bound[s], steps)
        if cell.status == "ok":
            best[0] = min(best[0], cell.step_s)

    for p in cheap:
        for s in problems:
            visit(s, p)
    fastest = {s: min((cells[(s, p)].step_s for p in cheap), default=math.inf) for s in problems}
    # Patterned schedules cost nothing here: the free-placement partitioners say n/a at once.
    free = sorted(
        (s for s in problems if not problems[s].patterned),
        key=lambda s: (fastest[s], schedules.index(s)),
    )
    searched = [s for s in problems if problems[s].patterned or s in free[:width] or not cheap]
    for s, p in sorted(
        ((s, p) for p in costly for s in searched),
        key=lambda sp: (bound[sp[0]], names.index(sp[1]), schedules.index(sp[0])),
    ):
        visit(s, p)
    bar.close()
    for s in problems:  # the costly cells of the schedules ranked out
        for p in costly:
            if (s, p) not in cells:
                cells[(s, p)] = _not_searched(s, p, bound[s], fastest[s], width)
    matrix = [cells[(s, p)] for s in schedules for p in names]
    return _winner(matrix), matrix


def _winner(matrix: list[Cell]) -> Cell:
    """The fastest step that fits; less traffic, then the matrix order, break ties."""
    ok = [i for i, c in enumerate(matrix) if c.status == "ok"]
    if not ok:
        why = "; ".join(dict.fromkeys(c.note for c in matrix if c.note))
        raise InfeasibleError(f"no schedule and partitioner give a plan that fits: {why}")
    return matrix[min(ok, key=lambda i: (matrix[i].step_s, matrix[i].plan.comm_bytes, i))]


def _per_schedule(problem: Problem, schedules, names, cells) -> tuple[dict, dict]:
    """Each schedule's problem and its lower bound on the step; a schedule whose problem
    cannot be made (e.g. too few micro-batches for its pattern) fills its cells as n/a."""
    problems: dict[str, Problem] = {}
    bound: dict[str, float] = {}
    for s in schedules:
        try:
            problems[s] = replace(problem, schedule=s)
        except FtpipeError as e:
            for p in names:
                cells[(s, p)] = Cell(s, p, "n/a", note=str(e))
            continue
        bound[s] = problems[s].micro_batches * problems[s].lower_bound()
    return problems, bound


def _not_searched(s: str, p: str, bound: float, fastest: float, width: int) -> Cell:
    why = f"{fastest:.4g} s" if fastest < math.inf else "none fits"
    note = (
        f"its best quick plan ({why}) is not among the {width} fastest "
        "free-placement schedules' (--search-width)"
    )
    return Cell(s, p, "not searched", bound, note=note)


def evaluate(problem: Problem, partitioner: str, bound: float, steps: int) -> Cell:
    """One cell: the partitioner's plan under the problem's schedule, simulated."""
    s = problem.schedule
    t0 = time.perf_counter()
    result = run_partitioner(problem, partitioner)
    if result.plan is None or not result.feasible:
        status = "n/a" if problem.patterned and partitioner not in PATTERNED else "infeasible"
        return Cell(
            s, partitioner, status, bound, search_s=result.search_seconds, note=result.error
        )
    sim = simulate(result.plan, steps=steps)
    status = "ok" if sim.fits else "does not fit"
    note = "" if sim.fits else f"needs {sim.max_memory_bytes / 2**30:.2f} GiB on its fullest GPU"
    return Cell(s, partitioner, status, bound, result.plan, sim, time.perf_counter() - t0, note)
