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
    of the same figures). Row k at once in numpy, each figure summed in the order a loop
    over the segment's nodes would add it (a cumulative sum adds left to right), so the
    floats are that loop's to the bit and the DP's ties fall as they did."""

    def __init__(self, costs: NodeCosts, units: list[list[int]], progress: bool = False):
        c, U = costs, len(units)
        r = _Readers(c, units)
        self.period = np.full((U, U), np.inf)
        self.static = np.full((U, U), np.inf)
        # What the memory of segment k..j depends on; the cost model turns it into bytes.
        self.trainable, self.frozen, self.state = (np.zeros((U, U)) for _ in range(3))
        self.inb, self.act = np.zeros((U, U)), np.zeros((U, U))
        self.has_out = np.zeros((U, U), dtype=bool)
        bw = c.problem.bandwidth
        rows = range(U - 1, -1, -1)  # last first: a reader's first unit from k on, kept
        for k in tqdm(rows, desc="chain segments", leave=False, disable=None if progress else True):
            r.reading(k)
            cols = np.arange(k, U)
            at = r.end[k:] - r.start[k]  # each unit's last node, counted from unit k's first
            rec, last, act = (np.cumsum(x[r.start[k] :])[at] for x in (r.rec, r.last, r.act))
            # Parameters first read in the segment: owned (static bytes, sent on while read
            # later), in the order they are first met; the others come in (`r.incoming`).
            a = int(np.searchsorted(r.first, k))
            upto = np.searchsorted(r.first, cols, side="right") - 1 - a
            owned = [np.where(upto >= 0, np.cumsum(v[a:])[np.maximum(upto, 0)], 0) if len(v) > a
                     else np.zeros(len(cols)) for v in r.owned]  # fmt: skip
            send = _spans(U - k, r.spans, k)
            inb, bwd = r.incoming(k)
            has = (cols >= r.out_unit) & (k <= r.out_unit)
            compute = np.where(has, last, rec)
            self.period[k, k:] = period_s(compute, send / bw, bwd / bw, maximum=np.maximum)
            self.static[k, k:], self.trainable[k, k:], self.frozen[k, k:], self.state[k, k:] = owned
            self.inb[k, k:], self.act[k, k:], self.has_out[k, k:] = inb, act, has
        for a in (self.period, self.static, self.trainable, self.frozen, self.state):
            a.flags.writeable = False
        for a in (self.inb, self.act, self.has_out):
            a.flags.writeable = False
        self._memory: dict[tuple, np.ndarray] = {}

    def memory(self, policies: tuple) -> np.ndarray:
        """Peak bytes of every segment under (the policy of a stage without the loss, with
        it): a DP asks at each depth, and a matrix asks again under each schedule."""
        got = self._memory.get(policies)
        if got is None:
            out = []
            for policy in policies:
                held, transient = stage_memory(
                    trainable_bytes=self.trainable,
                    frozen_bytes=self.frozen,
                    state_bytes=self.state,
                    input_bytes=self.inb,
                    act_bytes=self.act,
                    policy=policy,
                )
                out.append(held + transient)
            got = self._memory[policies] = np.where(self.has_out, out[1], out[0])
            got.flags.writeable = False
        return got


def _spans(n: int, spans: tuple, k: int) -> np.ndarray:
    """Bytes a segment from unit k sends on, per last unit j: each (first, end, bytes) span,
    sorted by first, counts from first to end - 1 where first >= k."""
    first, end, nbytes = spans
    b = int(np.searchsorted(first, k))
    d = np.zeros(n + 1, dtype=np.int64)
    np.add.at(d, first[b:] - k, nbytes[b:])
    np.add.at(d, end[b:] - k, -nbytes[b:])
    return np.cumsum(d)[:n]


class _Readers:
    """What `_Tables` reads of the graph, by unit: node figures in unit order, parameters in
    the order they are first read, spans of bytes sent on, and (`reading`, unit by unit from
    the last) each reader's first unit from k on."""

    def __init__(self, c: NodeCosts, units: list[list[int]]):
        U = len(units)
        self.units, self.c = units, c
        uo = [0] * c.n
        for k, nodes in enumerate(units):
            for i in nodes:
                uo[i] = k
        self.uo, self.out_unit = uo, uo[c.output]
        order = [i for nodes in units for i in nodes]
        sizes = np.array([len(u) for u in units], dtype=np.int64)
        self.end = np.cumsum(sizes) - 1
        self.start = self.end - sizes + 1
        self.rec = np.array([c.rec[i] for i in order], dtype=float)
        self.last = np.array([c.last[i] for i in order], dtype=float)
        self.act = np.array([c.act[i] for i in order])
        first, lastp, met = {}, {}, []  # parameter -> first and last unit reading it
        for k, nodes in enumerate(units):
            for i in nodes:
                for p in c.params[i]:
                    if p not in first:
                        first[p] = k
                        met.append(p)
                    lastp[p] = k
        self.first = np.array([first[p] for p in met], dtype=np.int64)
        self.owned = [np.array([getattr(c, f)[p] for p in met])
                      for f in ("pstatic", "ptrainable", "pfrozen", "pstate")]  # fmt: skip
        # Sent on: an owned weight while later units read it, a tensor until its last reader.
        last_use = [max((uo[s] for s in c.succs[i]), default=-1) for i in range(c.n)]
        spans = [(first[p], lastp[p], c.pbytes[p]) for p in met if lastp[p] > first[p]]
        spans += [(uo[i], last_use[i], c.out[i]) for i in range(c.n) if last_use[i] > uo[i]]
        spans.sort(key=lambda x: x[0])
        self.spans = tuple(np.array([x[i] for x in spans], dtype=np.int64) for i in range(3))
        P = len(c.pstatic)
        self.pfirst = np.array([first.get(p, U) for p in range(P)], dtype=np.int64)
        self.pbytes = np.array(c.pbytes, dtype=np.int64)
        self.pgrad = np.array([b if t else 0 for b, t in zip(c.pbytes, c.ptrain)], dtype=np.int64)
        self.producer = np.array(uo, dtype=np.int64)
        self.obytes = np.array(c.out, dtype=np.int64)
        self.ograd = np.array([b if g else 0 for b, g in zip(c.out, c.grad)], dtype=np.int64)
        self.xbytes = np.array(c.input_bytes, dtype=np.int64)
        # The first unit from k on reading each parameter, tensor of another unit, input.
        self.p_at = np.full(P, U, dtype=np.int64)
        self.t_at = np.full(c.n, U, dtype=np.int64)
        self.x_at = np.full(len(c.input_bytes), U, dtype=np.int64)
        self.U = U

    def reading(self, k: int) -> None:
        c, uo = self.c, self.uo
        for i in self.units[k]:
            for p in c.params[i]:
                self.p_at[p] = k
            for q in c.preds[i]:
                if uo[q] != k:
                    self.t_at[q] = k
            for x in c.inputs[i]:
                self.x_at[x] = k

    def incoming(self, k: int) -> tuple[np.ndarray, np.ndarray]:
        """(bytes a segment from unit k receives, bytes of gradient it sends back), per last
        unit: weights owned before k, tensors made before k, model inputs, each from the
        first unit reading it."""
        n, U = self.U - k, self.U
        inb, bwd = np.zeros(n + 1, dtype=np.int64), np.zeros(n + 1, dtype=np.int64)
        for at, mask, nbytes, grad in (
            (self.p_at, self.pfirst < k, self.pbytes, self.pgrad),
            (self.t_at, self.producer < k, self.obytes, self.ograd),
        ):
            m = mask & (at < U)
            np.add.at(inb, at[m] - k, nbytes[m])
            np.add.at(bwd, at[m] - k, grad[m])
        m = self.x_at < U
        np.add.at(inb, self.x_at[m] - k, self.xbytes[m])
        return np.cumsum(inb)[:n], np.cumsum(bwd)[:n]


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
        self.tables = got[1]
        self.period, self.static = self.tables.period, self.tables.static

    def __len__(self) -> int:
        return len(self.units)

    def memory(self, depth: int, length: int) -> np.ndarray:
        """Peak bytes of every segment as stage `depth` from the end of a chain of `length`
        (read-only: the tables keep it for the next chain whose policies there are alike)."""
        policies = tuple(self.c.chain_policy(depth, last, length) for last in (False, True))
        return self.tables.memory(policies)

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
        before = np.tri(U - 1, k=-1, dtype=bool)  # [k, j]: j < k, no segment
        ks = np.arange(U - 1)
        for d in range(stages):
            ok = self.memory(d, stages) <= (mem if budget is None else budget[d])
            if allowed is not None:
                ok &= allowed
            obj = np.where(ok, objective, inf)
            if d == 0:
                B[0, :U] = obj[:, U - 1]
                continue
            # Row k: the first j >= k of least max(segment k..j, the best rest from j + 1).
            # Where no j is finite, j = k (as the row's own argmin would say).
            rows = np.where(before, inf, np.maximum(obj[: U - 1, : U - 1], B[d - 1, 1:U]))
            j = np.argmin(rows, axis=1)
            B[d, : U - 1] = rows[ks, j]
            choice[d, : U - 1] = np.where(np.isfinite(B[d, : U - 1]), j, ks)
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
