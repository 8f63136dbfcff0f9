"""Greedy acyclic partitioning (after Herrmann et al., multilevel acyclic DAG partitioning).

Slices of a topological order always form an acyclic partition. For a few seeded orders
of the atoms (zero-cost nodes and heavy outputs folded in), binary-search the smallest
period T for which a greedy walk cuts the order into at most P slices, each within T of
compute and within memory; then refine by legal single-atom moves and keep the best.

The walk goes backwards from the loss: the first slice is the loss stage (its costs
without recompute where the schedule allows), and the i-th slice from the end has depth i,
so the in-flight micro-batches it must hold are known when it is cut.

    plan = acyclic(problem)
"""

from __future__ import annotations

import heapq
import random
import time
from typing import NamedTuple

from ..costs.formulas import stage_memory
from ..plan import Plan
from . import fit
from .assignment import Assignment
from .coarsen import atoms
from .indexed import NodeCosts
from .refine import BestRefined

ORDERS = (0.0, 2.0, 8.0, 32.0)  # noise (in atoms) added to the graph's order; 0: the order itself


def acyclic(problem) -> Plan:
    t0 = time.perf_counter()
    costs = NodeCosts.of(problem)
    coarse = atoms(costs)
    units = coarse.groups()
    why = "no slicing of a topological order fits"
    best = _search(costs, coarse, units, None)
    plan = best.plan(problem, "acyclic", t0, why)
    fits = fit.room(problem, plan) is None
    budget = best.best.budget  # lowered where the plan's own count found a GPU over (refit)
    for _ in range(fit.ROUNDS):  # slice again within it: refinement alone may not reach it
        if min(budget) >= problem.memory:
            break
        again = _search(costs, coarse, units, budget)
        if again.best is None:
            break
        other = again.plan(problem, "acyclic", t0, why)
        if fit.room(problem, other) is None:
            if not fits or _key(other) < _key(plan):
                plan = other
            break
        budget = again.best.budget  # the new cut moved what the runtime holds: lower again
    return plan


def _key(plan: Plan) -> tuple[float, int]:
    return round(plan.period_s, 12), plan.comm_bytes


def _search(costs: NodeCosts, coarse, units, budget: list[int] | None) -> BestRefined:
    """Every seeded order sliced and refined, within `budget` per GPU where given (else
    `problem.memory`)."""
    problem = costs.problem
    rng = random.Random(problem.seed)
    best = BestRefined(units)
    for noise in ORDERS:
        order = seeded_order(coarse, rng, noise)
        slices = bisect(costs, order, problem.gpus, budget=budget)
        if slices is None:
            continue
        stage_of = [0] * costs.n
        for s, sl in enumerate(slices):
            for u in sl:
                for i in u:
                    stage_of[i] = s
        lay = Assignment(costs, stage_of, list(range(len(slices))))
        if budget is not None:
            lay.budget = list(budget)
        best.offer(lay)
    return best


def seeded_order(coarse, rng: random.Random, noise: float) -> list[list[int]]:
    """A topological order of the atoms: Kahn's algorithm, priority = position + noise."""
    live = coarse.live()
    prio = {g: k + (rng.gauss(0.0, noise) if noise else 0.0) for k, g in enumerate(live)}
    indeg = {g: len(coarse.pred[g]) for g in live}
    heap = [(prio[g], g) for g in live if not indeg[g]]
    heapq.heapify(heap)
    out = []
    while heap:
        _, g = heapq.heappop(heap)
        out.append(coarse.members[g])
        for s in coarse.succ[g]:
            indeg[s] -= 1
            if not indeg[s]:
                heapq.heappush(heap, (prio[s], s))
    return out


def bisect(costs: NodeCosts, order: list[list[int]], gpus: int, rounds: int = 24, budget=None):
    """Smallest period (to 0.1%) whose greedy walk needs at most `gpus` slices."""
    lo = max(costs.problem.lower_bound(), 1e-12)
    hi = sum(costs.rec) + 1e-12
    atoms = {id(u): _Atom.of(costs, u) for u in order}  # each walk adds the same atoms
    best = greedy(costs, order, hi, gpus, atoms, budget)
    if best is None:
        return None
    for _ in range(rounds):
        if hi <= lo * 1.001:
            break
        mid = (lo + hi) / 2
        got = greedy(costs, order, mid, gpus, atoms, budget)
        if got is None:
            lo = mid
        else:
            hi, best = mid, got
    return best


def greedy(
    costs: NodeCosts, order: list[list[int]], period: float, gpus: int, atoms=None, budget=None
):
    """Cut `order` from its end into slices within `period` and memory; None if > gpus.
    `atoms`: id(atom) -> its `_Atom` (made here when not given); `budget`: bytes per GPU
    (the slice at depth d on GPU gpus - 1 - d), else `problem.memory` for each."""
    budget = budget or [costs.problem.memory] * gpus
    if atoms is None:
        atoms = {id(u): _Atom.of(costs, u) for u in order}
    slices: list[list[list[int]]] = []
    cur: list[list[int]] = []
    state = _Slice(costs, depth=0, length=gpus)
    mem = budget[gpus - 1]
    for u in reversed(order):
        if not state.add(atoms[id(u)], period, mem):
            if not cur:
                return None  # one atom alone is over the period or the memory
            slices.append(cur[::-1])
            if len(slices) >= gpus:
                return None
            cur, state = [], _Slice(costs, depth=len(slices), length=gpus)
            mem = budget[gpus - 1 - len(slices)]
            if not state.add(atoms[id(u)], period, mem):
                return None
        cur.append(u)
    slices.append(cur[::-1])
    return slices[::-1]


class _Atom(NamedTuple):
    """What an atom adds to a slice, summed once (in node order, as a walk would sum it)."""

    rec: float
    last: float
    act: int
    has_out: bool
    nodes: frozenset  # its nodes
    out: dict  # node -> bytes of its output (what a slice stops receiving if it takes it)
    ext: frozenset  # predecessors outside it
    inputs: frozenset  # model inputs it reads
    params: frozenset

    @classmethod
    def of(cls, c: NodeCosts, u: list[int]) -> _Atom:
        mine = frozenset(u)
        return cls(
            rec=sum(c.rec[i] for i in u),
            last=sum(c.last[i] for i in u),
            act=sum(c.act[i] for i in u),
            has_out=c.output in u,
            nodes=mine,
            out={i: c.out[i] for i in u},
            ext=frozenset(p for i in u for p in c.preds[i] if p not in mine),
            inputs=frozenset(x for i in u for x in c.inputs[i]),
            params=frozenset(p for i in u for p in c.params[i]),
        )


class _Slice:
    """Running compute and memory of a slice grown leftwards (towards the graph's inputs)."""

    def __init__(self, costs: NodeCosts, depth: int, length: int):
        self.c = costs
        self.policy = {last: costs.chain_policy(depth, last, length) for last in (False, True)}
        self.rec = self.last = 0.0
        self.act = self.inb = self.trainable = self.frozen = self.state = 0
        self.has_out = False
        self.counted: set[int] = set()
        self.params: set[int] = set()
        self.inputs: set[int] = set()

    def add(self, a: _Atom, period: float, mem: int) -> bool:
        """Take atom `a` if the slice stays within period and memory."""
        c = self.c
        rec = self.rec + a.rec
        last = self.last + a.last
        act = self.act + a.act
        has_out = self.has_out or a.has_out
        counted = self.counted
        # Byte counts are integers: the order of these sums cannot change them. Most sets
        # here are empty (an atom rarely brings a new input or parameter): a walk adds
        # thousands of atoms per period tried, so the empty cases cost no generator.
        taken = a.nodes & counted
        inb = self.inb - sum(a.out[i] for i in taken) if taken else self.inb
        ext = a.ext - counted
        if ext:
            out = c.out
            inb += sum(out[p] for p in ext)
        new_in = a.inputs - self.inputs if a.inputs else a.inputs
        if new_in:
            inb += sum(c.input_bytes[x] for x in new_in)
        new_p = a.params - self.params if a.params else a.params
        trainable, frozen, state = self.trainable, self.frozen, self.state
        if new_p:
            trainable += sum(c.ptrainable[p] for p in new_p)
            frozen += sum(c.pfrozen[p] for p in new_p)
            state += sum(c.pstate[p] for p in new_p)
        held, transient = stage_memory(
            trainable_bytes=trainable,
            frozen_bytes=frozen,
            state_bytes=state,
            input_bytes=inb,
            act_bytes=act,
            policy=self.policy[has_out],
        )
        if (last if has_out else rec) > period or held + transient > mem:
            return False
        self.rec, self.last, self.act, self.inb = rec, last, act, inb
        self.trainable, self.frozen, self.state = trainable, frozen, state
        self.has_out = has_out
        if taken:
            counted -= taken
        counted |= ext
        if new_p:
            self.params |= new_p
        if new_in:
            self.inputs |= new_in
        return True
