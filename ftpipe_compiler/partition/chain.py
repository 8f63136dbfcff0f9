"""Contiguous splits of a topological chain of units: segment figures and the exact DP.

A unit is a run of consecutive nodes in the graph's (topological) order. For every
segment k..j of units we precompute its period (FTPipe eq. 1 with the loss stage not
recomputing when the schedule says so) and what its memory depends on (parameter bytes,
inputs, activations), so the DP can ask the cost model for its memory at the depth where
the segment would sit, for all segments at once.

    ch = Chain(costs, units)            # units: lists of node indices, in order
    segs = ch.split(ch.period, gpus)    # [(k, j), ...] or None when nothing fits
    segs = ch.split(ch.period, 2 * gpus, exact=True, per_gpu=2)   # a schedule's pattern
    stage_of, gpu_of = ch.assignment(segs)  # segment s on the pattern's GPU for position s

Exact for contiguous splits when each tensor crosses to at most one later stage (a chain);
otherwise a tensor sent to several later stages is counted once here (the plan counts it
once per destination GPU), and depth is bounded by the stages after a segment. A parameter
read by several segments belongs to the first (its static memory) and is sent to the others
like a tensor, its gradient coming back.
"""

from __future__ import annotations

import time
from collections import Counter

import numpy as np
from tqdm import tqdm

from ..costs.formulas import period_s, stage_memory
from ..plan import Plan
from . import fit
from .build import build_plan
from .indexed import NodeCosts


class _Tables:
    """Segment k..j's figures for every k <= j (read-only arrays, shared by the chains made
    of the same figures)."""

    def __init__(self, costs: NodeCosts, units: list[list[int]], progress: bool = False):
        U = len(units)
        cons, prod_out, ends, out_unit, first_use, last_use_p = _unit_tables(costs, units)
        bw = costs.problem.bandwidth
        inf = float("inf")
        self.period = np.full((U, U), inf)
        self.static = np.full((U, U), inf)
        # What the memory of segment k..j depends on; the cost model turns it into bytes.
        self.trainable, self.frozen, self.state = (np.zeros((U, U)) for _ in range(3))
        self.inb, self.act = np.zeros((U, U)), np.zeros((U, U))
        self.has_out = np.zeros((U, U), dtype=bool)
        rng = tqdm(range(U), desc="chain segments", leave=False, disable=None if progress else True)
        for k in rng:
            rec = last = 0.0
            act = inb = bwd = send = static = trainable = frozen = state = 0
            seen, seen_in, params = set(), set(), set()
            weights_out: dict[int, int] = {}  # unit -> bytes of owned weights last read there
            has_out = False
            for j in range(k, U):
                for i in units[j]:
                    rec += costs.rec[i]
                    last += costs.last[i]
                    act += costs.act[i]
                    for p in costs.params[i]:
                        if p in params:
                            continue
                        params.add(p)
                        if first_use[p] < k:  # an earlier segment owns it and sends it here
                            inb += costs.pbytes[p]
                            bwd += costs.pbytes[p] if costs.ptrain[p] else 0
                            continue
                        static += costs.pstatic[p]
                        trainable += costs.ptrainable[p]
                        frozen += costs.pfrozen[p]
                        state += costs.pstate[p]
                        if last_use_p[p] > j:
                            send += costs.pbytes[p]
                            weights_out[last_use_p[p]] = (
                                weights_out.get(last_use_p[p], 0) + costs.pbytes[p]
                            )
                    for x in costs.inputs[i]:
                        if x not in seen_in:
                            seen_in.add(x)
                            inb += costs.input_bytes[x]
                has_out = has_out or j == out_unit
                for p, pu, b, g in cons[j]:
                    if pu < k and p not in seen:
                        seen.add(p)
                        inb += b
                        bwd += b if g else 0
                send += sum(prod_out[j])
                send -= sum(b for pu, b in ends[j] if k <= pu < j) + weights_out.pop(j, 0)
                self.period[k, j] = period_s(last if has_out else rec, send / bw, bwd / bw)
                self.static[k, j] = static
                self.trainable[k, j], self.frozen[k, j], self.state[k, j] = trainable, frozen, state
                self.inb[k, j], self.act[k, j], self.has_out[k, j] = inb, act, has_out
        for a in (self.period, self.static, self.trainable, self.frozen, self.state):
            a.flags.writeable = False
        for a in (self.inb, self.act, self.has_out):
            a.flags.writeable = False


_KEEP_TABLES = 4
_TABLES: dict[tuple, tuple] = {}  # fingerprint -> (the graph, kept alive for its id; _Tables)


def _fingerprint(costs: NodeCosts, units: list[list[int]]) -> tuple:
    """Everything `_Tables` reads: the graph's structure (its identity: NodeCosts takes the
    rest from it) and the figures the problem puts on it."""
    c = costs
    return (
        id(c.problem.graph),
        c.problem.bandwidth,
        tuple(map(tuple, units)),
        *(tuple(x) for x in (c.rec, c.last, c.act, c.pstatic, c.ptrainable, c.pfrozen, c.pstate)),
    )


class Chain:
    def __init__(self, costs: NodeCosts, units: list[list[int]], progress: bool = False):
        self.c, self.units = costs, units
        # Every schedule's cell of the matrix asks for the same chain: its tables are made once.
        key = _fingerprint(costs, units)
        got = _TABLES.get(key)
        if got is None:
            got = _TABLES[key] = (costs.problem.graph, _Tables(costs, units, progress))
            while len(_TABLES) > _KEEP_TABLES:
                _TABLES.pop(next(iter(_TABLES)))
        t = got[1]
        self.period, self.static = t.period, t.static
        self.trainable, self.frozen, self.state = t.trainable, t.frozen, t.state
        self.inb, self.act, self.has_out = t.inb, t.act, t.has_out

    def __len__(self) -> int:
        return len(self.units)

    def memory(self, depth: int, length: int) -> np.ndarray:
        """Peak bytes of every segment as stage `depth` from the end of a chain of `length`."""
        out = []
        for is_last in (False, True):
            held, transient = stage_memory(
                trainable_bytes=self.trainable,
                frozen_bytes=self.frozen,
                state_bytes=self.state,
                input_bytes=self.inb,
                act_bytes=self.act,
                policy=self.c.chain_policy(depth, is_last, length),
            )
            out.append(held + transient)
        return np.where(self.has_out, out[1], out[0])

    def split(
        self,
        objective: np.ndarray,
        gpus: int,
        exact: bool = False,
        allowed: np.ndarray | None = None,
        per_gpu: int = 1,
        budget=None,
    ) -> list[tuple[int, int]] | None:
        """Minimise the largest `objective[k, j]` over splits into at most (or exactly) `gpus`
        segments whose memory fits at their depth; ties prefer fewer stages. With `per_gpu`
        stages on each GPU (a schedule's pattern), each gets that share of the memory;
        `budget[d]`, where given, is what the segment at depth d may hold (partition/fit.py)."""
        c = self.c
        U, mem = len(self), c.problem.memory / per_gpu
        stages = min(gpus, U)
        inf = float("inf")
        B = np.full((stages, U + 1), inf)
        choice = np.zeros((stages, U), dtype=int)
        for d in range(stages):
            ok = self.memory(d, stages) <= (mem if budget is None else budget[d])
            if allowed is not None:
                ok &= allowed
            obj = np.where(ok, objective, inf)
            if d == 0:
                B[0, :U] = obj[:, U - 1]
                continue
            for k in range(U - 1):
                row = np.maximum(obj[k, k : U - 1], B[d - 1, k + 1 : U])
                j = int(np.argmin(row))
                B[d, k], choice[d, k] = row[j], k + j
        ds = [stages - 1] if exact else range(stages)
        d = min(ds, key=lambda d: (B[d, 0], d))
        if not np.isfinite(B[d, 0]):
            return None
        segs, k = [], 0
        while d > 0:
            j = int(choice[d, k])
            segs.append((k, j))
            k, d = j + 1, d - 1
        segs.append((k, U - 1))
        return segs

    def assignment(self, segs: list[tuple[int, int]]) -> tuple[dict[str, int], dict[int, int]]:
        """stage_of and gpu_of for build_plan: segment s on GPU s, or where the schedule's
        placement puts chain position s."""
        stage_of = {}
        for s, (k, j) in enumerate(segs):
            for u in range(k, j + 1):
                for i in self.units[u]:
                    stage_of[self.c.ids[i]] = s
        problem = self.c.problem
        if problem.patterned:
            chain = problem.sched.placement.chain(problem.gpus)
            return stage_of, {s: chain[s].gpu for s in range(len(segs))}
        return stage_of, {s: s for s in range(len(segs))}


def fitted(
    problem, chain: Chain, name: str, t0: float, objective, gpus: int, **split
) -> Plan | None:
    """The plan of `chain.split(objective, gpus, **split)`; None where no split fits. Where
    a GPU is over by the plan's full count, split again with the budget of the segments on
    that GPU lowered to the room the plan left them (`fit.room`, shared among a GPU's
    segments), at most `fit.ROUNDS` times. A split that still does not fit is returned as it
    is, for the plan's check to report."""
    segs = chain.split(objective, gpus, **split)
    if segs is None:
        return None
    length = min(gpus, len(chain))  # the depths `split` costs segments at
    budget = [problem.memory / problem.per_gpu] * length
    gpu_of: dict[int, int] = {}

    def build(got):  # the plan of a split, which `recut` lowers the budgets of
        nonlocal segs, gpu_of
        segs = got
        stage_of, gpu_of = chain.assignment(segs)
        return build_plan(problem, stage_of, gpu_of, name, time.perf_counter() - t0)

    def recut(plan, free):
        shared = Counter(gpu_of.values())
        for s, (k, j) in enumerate(segs):
            d = len(segs) - 1 - s
            own = chain.memory(d, length)[k, j]
            budget[d] = min(budget[d], own + free[gpu_of[s]] / shared[gpu_of[s]])
        got = chain.split(objective, gpus, budget=budget, **split)
        return None if got is None else build(got)

    return fit.again(problem, build(segs), recut)[0]


def _unit_tables(costs: NodeCosts, units: list[list[int]]):
    """Per unit: the tensors it reads from other units (producer, its unit, bytes, grad),
    the bytes it produces for later units, the tensors whose last reader it is; the loss's
    unit; each parameter's first and last reading unit."""
    U = len(units)
    uo = [0] * costs.n
    for k, nodes in enumerate(units):
        for i in nodes:
            uo[i] = k
    last_use = [max((uo[s] for s in costs.succs[i]), default=-1) for i in range(costs.n)]
    cons, prod_out, ends = (
        [[] for _ in range(U)],
        [[] for _ in range(U)],
        [[] for _ in range(U)],
    )
    for j, nodes in enumerate(units):
        ext = sorted({p for i in nodes for p in costs.preds[i] if uo[p] != j})
        cons[j] = [(p, uo[p], costs.out[p], costs.grad[p]) for p in ext]
        for i in nodes:
            if last_use[i] > j:
                prod_out[j].append(costs.out[i])
                ends[last_use[i]].append((uo[i], costs.out[i]))
    out_unit = uo[costs.output]
    first_use, last_use_p = {}, {}  # parameter -> first and last unit reading it
    for k, nodes in enumerate(units):
        for i in nodes:
            for p in costs.params[i]:
                first_use.setdefault(p, k)
                last_use_p[p] = k
    return cons, prod_out, ends, out_unit, first_use, last_use_p


def runs(costs: NodeCosts, key) -> list[list[int]]:
    """Runs of consecutive nodes (graph order) whose scopes share `key(scope)`."""
    nodes = costs.problem.graph.nodes
    out: list[list[int]] = []
    prev = None
    for i, n in enumerate(nodes):
        k = key(n.scope)
        if out and k == prev:
            out[-1].append(i)
        else:
            out.append([i])
        prev = k
    return out


def compress(costs: NodeCosts, units: list[list[int]], max_units: int) -> list[list[int]]:
    """Join consecutive units until about `max_units` remain, each near an equal share of work."""
    if len(units) <= max_units:
        return units
    share = sum(costs.rec) / max_units
    out: list[list[int]] = []
    acc = 0.0
    for u in units:
        w = sum(costs.rec[i] for i in u)
        if out and acc + w <= share:
            out[-1].extend(u)
            acc += w
        else:
            out.append(list(u))
            acc = w
    return out
