"""Refinement by single-unit moves across stage borders (FTPipe §4.1 step 3, Herrmann et al.).

A unit (a node, or an atom of nodes that must stay together) may move to a stage between
the last stage of its predecessors and the first stage of its successors: with stages
numbered topologically, every edge still goes forwards, so the stage graph stays acyclic
by construction. Only the two neighbouring stages of that range are tried (a move to an
unrelated stage would only add transfers). A start that does not fit first takes the moves
that lower the memory over the limit most. Then a move is kept when it lowers the slowest
GPU's period, or keeps it and lowers the sum of squared periods (spreads load away from a
second bottleneck), or keeps both and lowers the bytes communicated — always within memory
(each GPU's `Assignment.budget`; `refit` lowers it where the plan's full count is over).

    refine(assignment, units) -> number of moves made
    best = BestRefined(units); best.offer(assignment) ...; best.plan(problem, "metis", t0, why)
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from . import fit
from .assignment import Assignment
from .build import build_plan
from .indexed import NodeCosts, infeasible

EPS = 1e-12


def _score(lay: Assignment) -> tuple[float, float, int]:
    per = lay.periods()
    return max(per), sum(p * p for p in per), lay.comm_bytes()


def _better(new: tuple, old: tuple) -> bool:
    tol = EPS * max(1.0, old[0])
    if new[0] < old[0] - tol:
        return True
    if new[0] > old[0] + tol:
        return False
    tol2 = EPS * max(1.0, old[1])
    if new[1] < old[1] - tol2:
        return True
    return new[1] <= old[1] + tol2 and new[2] < old[2]


@dataclass(frozen=True)
class Units:
    """The units and what refinement reads of them that no move changes: made once per
    search (Mixed-pipe refines 16 starts on the same units, METIS 12), not once per start."""

    nodes: list[list[int]]
    unit_of: list[int]  # unit of every node
    preds: list[list[int]]  # each unit's predecessor nodes outside it
    succs: list[list[int]]  # ... successor nodes
    near: list[list[int]]  # the units those belong to
    # (work when its stage recomputes, work in the loss stage, whether it holds the loss)
    work: list[tuple[float, float, bool]]

    @classmethod
    def of(cls, c: NodeCosts, units: list[list[int]]) -> Units:
        unit_of = [0] * c.n
        for k, nodes in enumerate(units):
            for i in nodes:
                unit_of[i] = k
        preds, succs = [], []
        for k, nodes in enumerate(units):
            preds.append(sorted({p for i in nodes for p in c.preds[i] if unit_of[p] != k}))
            succs.append(sorted({s for i in nodes for s in c.succs[i] if unit_of[s] != k}))
        near = [sorted({unit_of[i] for i in preds[k] + succs[k]}) for k in range(len(units))]
        work = [(sum(c.rec[i] for i in u), sum(c.last[i] for i in u), c.output in u) for u in units]
        return cls(units, unit_of, preds, succs, near, work)


def refine(lay: Assignment, units: list[list[int]] | Units, max_moves: int = 20000) -> int:
    """Greedy best-move refinement, slowest GPU first; every unit must sit in one stage.

    Stops when no move helps. `max_moves` is a safety net (the models we ship converge in
    well under a second); it counts moves, not seconds, so the plan never depends on how
    busy the machine is. `units` made into `Units` once serve every start of a search.
    """
    if not isinstance(units, Units):
        units = Units.of(lay.c, units)
    preds, succs, near, work = units.preds, units.succs, units.near, units.work
    units = units.nodes
    # Units with a neighbour in another stage, by stage: the only ones that can move.
    border: dict[int, set[int]] = {s: set() for s in range(lay.nstages)}
    where: dict[int, int] = {}  # unit -> the stage whose border holds it
    # Unit -> the stages it may move to (`_targets`): they change only when it or a
    # neighbour moves, and every search for a move asks again for each unit on a border.
    reachable: dict[int, list[int]] = {}

    def reach(k: int) -> list[int]:
        got = reachable.get(k)
        if got is None:
            got = reachable[k] = _targets(lay, lay.stage[units[k][0]], preds[k], succs[k])
        return got

    def update(k: int) -> None:
        """Unit k or a neighbour moved: its border and targets are made again."""
        reachable.pop(k, None)
        s = lay.stage[units[k][0]]
        was = where.pop(k, None)
        if was is not None:
            border[was].discard(k)
        if any(lay.stage[i] != s for i in preds[k]) or any(lay.stage[i] != s for i in succs[k]):
            border[s].add(k)
            where[k] = s

    for k in range(len(units)):
        update(k)
    moves = 0
    while not lay.fits() and moves < max_moves:
        best = _fit_move(lay, units, border, reach)
        if best is None:
            return moves  # no single move brings memory down: leave it to the caller
        k, t = best
        lay.move(units[k], t)
        for m in [k, *near[k]]:
            update(m)
        moves += 1
    cur = _score(lay)
    while moves < max_moves:
        per = lay.periods()
        best = None
        # The slowest GPU first; when it has no good move, a lighter one may shed load so
        # that a later move off the slowest becomes possible (lower sum of squares).
        for g in sorted(range(lay.gpus), key=lambda g: (-per[g], g)):
            best = _best_move(lay, g, units, border, reach, cur, per, work)
            if best is not None:
                break
        if best is None:
            break
        cur, k, t = best
        lay.move(units[k], t)
        for m in [k, *near[k]]:
            update(m)
        moves += 1
    return moves


def _fit_move(lay, units, border, reach):
    """The move off an over-full GPU that lowers the total overflow most (then the period)."""
    cur = (lay.overflow(), lay.period())
    best = None
    for g in range(lay.gpus):
        if lay.memory(g) <= lay.budget[g]:
            continue
        for s in lay.on[g]:
            for k in sorted(border[s]):
                for t in reach(k):
                    if lay.gpu[t] == g:
                        continue
                    before = lay.move(units[k], t)
                    over = lay.overflow()
                    # The period decides only between equal overflows: most moves lose on
                    # the overflow alone, and a period costs more to count.
                    if over <= cur[0] and (best is None or over <= best[0][0]):
                        new = (over, lay.period())
                        if new < cur and (best is None or new < best[0]):
                            best = (new, k, t)
                    lay.undo(units[k], before)
    return None if best is None else best[1:]


def _best_move(lay, g, units, border, reach, cur, per, work):
    best = None
    loss, top, least = lay.loss, max(per), min(per)
    for s in lay.on[g]:
        for k in sorted(border[s]):
            rec, last, has_out = work[k]
            if not has_out and least + min(rec, last) >= per[g]:
                continue  # every target would grow as slow as g (the test below, for all)
            for t in reach(k):
                h = lay.gpu[t]
                if h == g:
                    continue
                # A GPU's period is at least its compute: skip moves that must make the
                # target as slow as the source or the slowest (exact when transfers hide).
                grown = per[h] + (last if t == loss else rec)
                if not has_out and (grown > top * (1 + EPS) or grown >= per[g]):
                    continue
                before = lay.move(units[k], t)
                new = _score(lay)
                if (best is None or _better(new, best[0])) and _better(new, cur) and lay.fits():
                    best = (new, k, t)
                lay.undo(units[k], before)
    return best


def _targets(lay: Assignment, s: int, preds: list[int], succs: list[int]) -> list[int]:
    """The legal neighbouring stages of a unit now in stage s (none if it is interior)."""
    at = lay.stage.__getitem__
    lo = max(map(at, preds)) if preds else -1
    hi = min(map(at, succs)) if succs else lay.nstages
    out = []
    if 0 <= lo != s:
        out.append(lo)
    if hi < lay.nstages and hi != s and hi != lo:
        out.append(hi)
    return out


class BestRefined:
    """Refine each start and keep the fitting one of lowest (period, bytes sent): the search
    loop of the partitioners that try several starts (acyclic, metis)."""

    def __init__(self, units: list[list[int]]):
        self.units, self.key, self.best = units, None, None

    def offer(self, lay: Assignment) -> None:
        if not isinstance(self.units, Units):  # once, for every start offered
            self.units = Units.of(lay.c, self.units)
        refine(lay, self.units)
        key = (round(lay.period(), 12), lay.comm_bytes())
        if lay.fits() and (self.key is None or key < self.key):
            self.key, self.best = key, lay

    def plan(self, problem, name: str, t0: float, why: str):
        """The best start's plan, refitted where a GPU is over by the plan's count (`refit`);
        `why` says what did not fit when none did."""
        if self.best is None:
            raise infeasible(problem, name, why)
        return refit(problem, self.best, self.units, name, t0)[0]


def refit(problem, lay: Assignment, units: list[list[int]], name: str, t0: float, plan=None):
    """(`lay`'s plan, whether it fits; its search began at `t0`): `plan`, where already
    built from it; where a GPU is over by the plan's full count, `lay` refined again with each
    GPU's budget lowered to the room the plan left it (`fit.room`: the moves off an over-full
    GPU first), at most `fit.ROUNDS` times. A cut that still does not fit is returned as it
    is, for the plan's check to report."""

    def recut(plan, free):
        lay.budget = [min(b, lay.memory(g) + r) for g, (b, r) in enumerate(zip(lay.budget, free))]
        refine(lay, units)
        if not lay.fits():
            return None
        return build_plan(problem, lay.stage_of(), lay.gpu_of(), name, time.perf_counter() - t0)

    plan = plan or build_plan(problem, lay.stage_of(), lay.gpu_of(), name, time.perf_counter() - t0)
    return fit.again(problem, plan, recut)
