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
3. No plan under a schedule simulates a step faster than its floor (`bounds.step_floor`: m x
   the lower bound on the period, every GPU computing its share of m micro-batches per step;
   under a synchronous schedule also one micro-batch's round trip); a cell
   whose bound is not below the best step found so far is skipped, marked "pruned" with
   both figures.
The matrix keeps every cell: figures, or why it has none (not applicable, infeasible, does
not fit, not searched, pruned). The search is deterministic: no time budget, only counts.

Every core works (`workers`, default one process per core, forked so that they inherit the
problem): cells are evaluated ahead of the order above, the costly ones as soon as the
free-placement schedules' quick cells rank them, and settled in that order, so pruning and
the matrix are exactly those of one process evaluating each cell when its turn comes.
"""

from __future__ import annotations

import gc
import math
import multiprocessing
import os
import signal
import time
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, replace
from itertools import product

from ftpipe_runtime.job.signals import Terminated, held
from ftpipe_runtime.schedules import SCHEDULES, StageInfo, get_schedule

from ..errors import FtpipeError, InfeasibleError, unknown
from ..partition import PARTITIONERS, PATTERNED, SPLIT, Problem, run_partitioner
from ..plan import Plan
from ..simulate import SimResult, simulate, steady_steps
from .bounds import step_floor
from .offload import choose_offload

__all__ = [
    "CHEAP",
    "GROUPS",
    "Cell",
    "CellPool",
    "kept_sim",
    "NothingFits",
    "cores",
    "evaluate",
    "schedule_names",
    "search_matrix",
    "update_rule",
]

CHEAP = ("even-layers", "params", "pipedream")  # a second or less each, even on T5-3B
# The others by their time on T5-3B (8 GPUs: about 5, 4 and 1 s): workers take the longest
# first, so that one is not left with the longest at the end.
SLOWEST_FIRST = ("mixed", "metis", "acyclic")
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
    progress: Callable[[int, int, str], None] | None = None,
    workers: int | None = None,
) -> tuple[Cell, list[Cell]]:
    """(the fastest cell whose plan fits, every cell in schedule x partitioner order).

    `workers` processes evaluate the cells (default: one per core; 1: here, one after the
    other); the result is the same whatever the number. `progress(done, total, what)` is
    called as cells are settled."""
    schedules = list(SCHEDULES) if schedules is None else list(schedules)
    names = list(PARTITIONERS) if partitioners is None else list(partitioners)
    for n in names:
        if n not in PARTITIONERS:
            raise unknown("partitioner", n, PARTITIONERS)
    cells: dict[tuple[str, str], Cell] = {}
    problems, bound = _per_schedule(problem, schedules, names, cells)
    cheap = [p for p in names if p in CHEAP]
    costly = [p for p in names if p not in CHEAP]
    total = len(problems) * len(names)
    best = [math.inf]

    def wanted(pool: CellPool, cells_: list[tuple[str, str]]) -> list[tuple]:
        return [key for s, p in cells_ for key in split_keys((s, p), problems[s], pool.parts)]

    def result(pool: CellPool, s: str, p: str) -> Cell:
        keys = split_keys((s, p), problems[s], pool.parts)
        return pool.joined((s, p), keys, lambda got: evaluate(problems[s], p, bound[s], steps, got))

    def settle(pool: CellPool, s: str, p: str) -> None:
        """The cell as the search in order makes it: pruned by the best step so far, or
        evaluated (in a worker, perhaps ahead of time)."""
        if bound[s] >= best[0]:
            note = f"step >= {bound[s]:.4g} s, not below the best {best[0]:.4g} s"
            cells[(s, p)] = Cell(s, p, "pruned", bound[s], note=note)
            for key in split_keys((s, p), problems[s], pool.parts):
                pool.drop(key)
        else:
            cells[(s, p)] = cell = result(pool, s, p)
            if cell.status == "ok":
                best[0] = min(best[0], cell.step_s)
        if progress:
            progress(sum(k in cells for k in product(problems, names)), total, f"{p} / {s}")

    def costly_cells(fastest: dict) -> list[tuple[str, str]]:
        """The costly partitioners' cells: under the `width` free-placement schedules whose
        quick plans are fastest (and the patterned ones, where they say n/a at once), lowest
        bound first."""
        free = sorted(
            (s for s in problems if not problems[s].patterned),
            key=lambda s: (fastest[s], schedules.index(s)),
        )
        searched = [s for s in problems if problems[s].patterned or s in free[:width] or not cheap]
        return sorted(
            ((s, p) for p in costly for s in searched),
            key=lambda sp: (bound[sp[0]], names.index(sp[1]), schedules.index(sp[0])),
        )

    quick = [(s, p) for p in cheap for s in problems]

    def run(key: tuple):
        if len(key) == 4:  # one part of a `SPLIT` partitioner's search (`split_keys`)
            return SPLIT[key[1]][0](problems[key[0]], key[2], key[3])
        # `evaluate` looked up at each call (tests put another in its place before the fork).
        return evaluate(problems[key[0]], key[1], bound[key[0]], steps)

    with CellPool(run, workers) as pool:
        # The free-placement schedules' quick cells first: they choose where the costly
        # partitioners run, which start (a guess) as soon as those are in, before the
        # patterned schedules' quick cells.
        pool.want([(s, p) for s, p in quick if not problems[s].patterned])
        if pool.ahead and cheap:  # the ranking as it will be unless pruning changes it
            guess = {s: math.inf if problems[s].patterned
                     else min(pool.result((s, p)).step_s for p in cheap) for s in problems}  # fmt: skip
            pool.want(wanted(pool, sorted(costly_cells(guess), key=_slowest_first)))
        pool.want(quick)
        for s, p in quick:
            settle(pool, s, p)
        fastest = {s: min((cells[(s, p)].step_s for p in cheap), default=math.inf)
                   for s in problems}  # fmt: skip
        later = costly_cells(fastest)
        pool.want(wanted(pool, later), first=True)
        for s, p in later:
            settle(pool, s, p)
    for s in problems:  # the costly cells of the schedules ranked out
        for p in costly:
            if (s, p) not in cells:
                cells[(s, p)] = _not_searched(s, p, bound[s], fastest[s], width)
    matrix = [cells[(s, p)] for s in schedules for p in names]
    winner = _winner(matrix)
    kept = replace(winner, sim=kept_sim(winner.plan, steps))
    return kept, [kept if c is winner else c for c in matrix]


def split_keys(cell: tuple, problem: Problem, parts: int) -> list[tuple]:
    """The pool's keys that make `cell` (its last item the partitioner's name): where that
    partitioner's search is made in parts (`partition.SPLIT`), the problem places its stages
    freely and `parts` cores share them, one key per part (its number, and how many); else
    the cell itself. The parts are joined in the parent (`run_partitioner(..., parts)`)."""
    if cell[-1] in SPLIT and parts > 1 and not problem.patterned:
        return [(*cell, i, parts) for i in range(parts)]
    return [cell]


def kept_sim(plan: Plan, steps: int) -> SimResult:
    """The plan a search keeps, simulated again: its action lists validated (FtpipeError if
    they do not hold) and `steady_steps` of them. A search's cells are simulated unchecked and
    `steady`, which ranks them as many steps do (step times equal to 1e-12 on T5-3B's 36 plans
    of 8 GPUs) but may end before a figure that does not decide the rank settles (bytes sent
    by an asynchronous plan whose weights' versions fall differently in later steps). The
    drain after the last step is left out: it changes no figure."""
    return simulate(plan, steps=steady_steps(plan.micro_batches, steps), drain=False)


def _slowest_first(cell: tuple[str, str]) -> int:
    p = cell[1]
    return SLOWEST_FIRST.index(p) if p in SLOWEST_FIRST else len(SLOWEST_FIRST)


def cores() -> int:
    """The cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


# What the workers run: set before they fork, so they inherit it instead of each task
# carrying the problem (a T5-3B graph is a megabyte of pickle).
_SHARED: dict = {}


def _leave_signals_to_the_parent() -> None:
    """Workers leave Ctrl-C to the parent, which stops them (no traceback from each), and
    end at once on SIGTERM: forked, they inherited the command's SIGTERM handler, which
    raised Terminated inside multiprocessing's own code (a traceback from each, or a cell
    "failing" with it and its worker waiting for more work, a queue lock held: a hang)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)


def _run_shared(key):
    return _SHARED["run"](key)


class CellPool:
    """`run(key)` for the cells (hashable keys) of a search, by a pool of forked workers, at
    most one per worker in flight, the wanted ones in order (so that later wishes can go
    first); with one worker, here, when asked for. Results are the same either way: `run`
    depends on its key alone (the matrix's cells, the cluster planner's)."""

    def __init__(self, run: Callable, workers: int | None):
        self.run = run
        self.workers = cores() if workers is None else workers
        self.ahead = self.workers > 1 and "fork" in multiprocessing.get_all_start_methods()
        self.queue: list[tuple[str, str]] = []
        self.running: dict[tuple[str, str], Future] = {}
        self.done: dict[tuple[str, str], Cell] = {}
        self.executor = None
        self.seen: dict = {}  # pid -> worker, all started so far
        self.parts_joined: dict = {}  # key -> its parts' results joined (`joined`)

    def __enter__(self) -> CellPool:
        # What exists now (the traced model, the graph, the problem: over a million objects
        # in a compile) lives as long as the search: frozen, the collector's full passes,
        # here and in the workers forked with it, skip it. They took a seventh of a
        # Mixed-pipe search, visiting all of it each time.
        gc.freeze()
        if self.ahead:
            _SHARED["run"] = self.run
            context = multiprocessing.get_context("fork")
            self.executor = ProcessPoolExecutor(
                self.workers, mp_context=context, initializer=_leave_signals_to_the_parent
            )
        return self

    def __exit__(self, error, *exc) -> None:
        gc.unfreeze()  # (the workers keep theirs)
        if self.executor is None:
            return
        _SHARED.pop("run", None)
        busy = [f for f in self.running.values() if not f.done()]
        if not busy and error is None:
            self.executor.shutdown()
            return
        # A cell guessed ahead and not needed after all, or an error, Ctrl-C or SIGTERM here
        # (maybe inside the executor's own bookkeeping): stop the workers rather than wait
        # for work nobody will read.
        manager = getattr(self.executor, "_executor_manager_thread", None)
        results = getattr(self.executor, "_result_queue", None)
        workers = self._processes()
        self.executor.shutdown(wait=False, cancel_futures=True)
        for w in workers:
            w.terminate()
        for w in workers:
            w.join()
        # Then the executor's thread ends here, not at Python's exit, which wakes it through
        # a pipe the thread may be closing (an OSError printed as the command ends). A
        # worker stopped while sending a result left that thread reading the rest of it:
        # with no worker left, closing this process's end of the pipe ends that read.
        if results is not None:
            results._writer.close()
        if manager is not None:
            manager.join()

    @property
    def parts(self) -> int:
        """How many parts a `SPLIT` partitioner's cell is made in (`split_keys`): one per
        worker, or one where the cells run here."""
        return self.workers if self.ahead else 1

    def want(self, keys, first: bool = False) -> None:
        """Evaluate these cells ahead of time, after those wanted earlier (`first`: before
        them, the ones already waiting moved up)."""
        if not self.ahead:
            return
        keys = [k for k in dict.fromkeys(keys) if k not in self.done and k not in self.running]
        if first:
            self.queue = keys + [k for k in self.queue if k not in keys]
        else:
            self.queue += [k for k in keys if k not in self.queue]
        self._fill()

    def drop(self, key) -> None:
        """Not needed after all (pruned): not started if it has not."""
        if key in self.queue:
            self.queue.remove(key)

    def result(self, key):
        if not self.ahead:
            return self.run(key)
        if key not in self.done and key not in self.running and key not in self.queue:
            self.want([key], first=True)
        while key not in self.done:
            finished, _ = wait(list(self.running.values()), return_when=FIRST_COMPLETED)
            for k, f in list(self.running.items()):
                if f in finished:
                    self.done[k] = self._result(f)
                    del self.running[k]
            self._fill()
        return self.done[key]

    def joined(self, key, keys: list, join: Callable):
        """`key`'s result: the pool's where it was made whole (`keys == [key]`), else
        `join(results of keys)`, its parts' (`split_keys`) joined here once and kept."""
        if keys == [key]:
            return self.result(key)
        if key not in self.parts_joined:
            self.parts_joined[key] = join([self.result(k) for k in keys])
        return self.parts_joined[key]

    def _result(self, f: Future):
        """The cell's result; a worker's exception is raised here. A worker ended by SIGTERM
        (`kill`, a memory watchdog's polite stop) stops the search as SIGTERM stops ftpipe."""
        try:
            return f.result()
        except BrokenProcessPool:
            if any(w.exitcode == -signal.SIGTERM for w in self._processes()):
                raise Terminated() from None
            raise

    def _fill(self) -> None:
        while self.queue and len(self.running) < self.workers:
            key = self.queue.pop(0)
            if key not in self.done and key not in self.running:
                with held():  # the first submit forks the workers
                    self.running[key] = self.executor.submit(_run_shared, key)
                self._processes()

    def _processes(self) -> list:
        """The workers started so far (the executor's own record, kept here: a broken pool
        may forget its dead)."""
        self.seen.update(getattr(self.executor, "_processes", None) or {})
        return list(self.seen.values())


class NothingFits(InfeasibleError):
    """No cell of the matrix fits; `matrix` holds them all, each with its own reason."""

    def __init__(self, message: str, matrix: list[Cell]):
        super().__init__(message)
        self.matrix = matrix


def _winner(matrix: list[Cell]) -> Cell:
    """The fastest step that fits; less traffic, then the matrix order, break ties."""
    ok = [i for i, c in enumerate(matrix) if c.status == "ok"]
    if not ok:
        why = "; ".join(dict.fromkeys(c.note for c in matrix if c.note))
        raise NothingFits(f"no schedule and partitioner give a plan that fits: {why}", matrix)
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
        bound[s] = step_floor(problems[s])
    return problems, bound


def _not_searched(s: str, p: str, bound: float, fastest: float, width: int) -> Cell:
    why = f"{fastest:.4g} s" if fastest < math.inf else "none fits"
    note = (
        f"its best quick plan ({why}) is not among the {width} fastest "
        "free-placement schedules' (--search-width)"
    )
    return Cell(s, p, "not searched", bound, note=note)


def evaluate(problem: Problem, partitioner: str, bound: float, steps: int,
             parts: list | None = None) -> Cell:  # fmt: skip
    """One cell: the partitioner's plan under the problem's schedule, simulated (`parts`: a
    `SPLIT` partitioner's parts of its search, made already, to join)."""
    s = problem.schedule
    t0 = time.perf_counter() - sum(seconds for _, seconds in parts or ())
    result = run_partitioner(problem, partitioner, parts)
    if result.plan is None or not result.feasible:
        status = "n/a" if problem.patterned and partitioner not in PATTERNED else "infeasible"
        return Cell(
            s, partitioner, status, bound, search_s=result.search_seconds, note=result.error
        )
    plan = choose_offload(result.plan, problem.offload, step=problem.offload_step)
    sim = simulate(plan, steps=steps, checked=False, steady=True)
    status = "ok" if sim.fits else "does not fit"
    note = "" if sim.fits else _overflow(sim)
    return Cell(s, partitioner, status, bound, plan, sim, time.perf_counter() - t0, note)


def _overflow(sim: SimResult) -> str:
    if not sim.host_fits:
        node = max(sim.nodes, key=lambda n: n.host_bytes - n.host_memory_bytes)
        return f"needs {node.host_bytes / 2**30:.2f} GiB of host memory on node {node.node}"
    return f"needs {sim.max_memory_bytes / 2**30:.2f} GiB on its fullest GPU"
