"""METIS k-way partitioning (pymetis), repaired into an acyclic pipeline.

METIS balances integer vertex weights (compute) and minimises the cut (bytes) on the
undirected graph of blocks (atoms joined by scope, as multilevel partitioners coarsen
before they cut: on single atoms the parts scatter along skip connections such as T5's
position bias); it knows nothing of direction, so its parts may form cycles.
Two repairs compete, each followed by refinement by legal moves:

- `ranked`: parts are numbered by the mean topological position of their work, and in
  topological order every atom takes stage max(its part's number, its predecessors'
  stages): one stage per GPU, a pipeline as deep as the number of GPUs.
- `split`: each part is a GPU whose atoms are cut into stages along a topological order
  that stays on one part as long as it can, then connected stages of a GPU are joined
  where no path leaves the GPU and returns (as in Mixed-pipe). Deeper pipelines, which
  hold more in-flight inputs, so this one often does not fit.

    plan = metis(problem)
"""

from __future__ import annotations

import contextlib
import ctypes
import heapq
import os
import sys
import time

import pymetis

from ..graph.granularity import layer_key, sublayer_key
from ..plan import Plan
from .assignment import Assignment
from .coarsen import atoms, by_scope
from .indexed import NodeCosts
from .mixed import stages
from .refine import BestRefined

SCALE = 1_000_000  # METIS weights are integers: the heaviest atom weighs about this much
# (seed offset, ufactor: allowed imbalance in 1/1000, share of memory in the vertex weight).
# METIS balances one weight; mixing in static memory spreads layers that are light in
# compute but heavy in parameters (T5's decoder) over enough GPUs to fit.
TRIES = ((0, 30, 0.0), (1, 10, 0.0), (2, 30, 0.5))


def metis(problem) -> Plan:
    t0 = time.perf_counter()
    costs = NodeCosts.of(problem)
    coarse = atoms(costs)
    units = coarse.groups()
    best = BestRefined(units)
    for scope in (layer_key, sublayer_key):
        blocks = by_scope(coarse.copy(), scope).groups()
        for offset, ufactor, alpha in TRIES if problem.gpus > 1 else TRIES[:1]:
            part = kway(costs, blocks, problem.gpus, problem.seed + offset, ufactor, alpha)
            for repaired in (
                ranked(costs, blocks, part),
                stages(costs, *split(costs, blocks, part)),
            ):
                best.offer(Assignment(costs, *repaired))
    return best.plan(problem, "metis", t0, "no repaired METIS partition fits")


def kway(
    costs: NodeCosts,
    units: list[list[int]],
    parts: int,
    seed: int,
    ufactor: int,
    alpha: float = 0.0,
) -> list[int]:
    """pymetis part of every unit (all 0 for one part); weight = compute, alpha of it memory."""
    if parts == 1 or len(units) <= 1:
        return [0] * len(units)
    unit_of = {i: k for k, u in enumerate(units) for i in u}
    work = [sum(costs.rec[i] for i in u) for u in units]
    static = [sum(costs.pstatic[p] for p in {p for i in u for p in costs.params[i]}) for u in units]
    wsum, ssum = sum(work) or 1.0, sum(static) or 1
    work = [(1 - alpha) * w / wsum + alpha * m / ssum for w, m in zip(work, static)]
    wmax = max(work) or 1.0
    adj: list[dict[int, int]] = [{} for _ in units]
    for k, u in enumerate(units):
        for i in u:
            for j in costs.succs[i]:
                m = unit_of[j]
                if m != k:
                    adj[k][m] = adj[k].get(m, 0) + costs.out[i]
                    adj[m][k] = adj[m].get(k, 0) + costs.out[i]
    bmax = max((b for a in adj for b in a.values()), default=1) or 1
    xadj, adjncy, eweights = [0], [], []
    for a in adj:
        for m in sorted(a):
            adjncy.append(m)
            eweights.append(max(1, round(a[m] / bmax * SCALE)))
        xadj.append(len(adjncy))
    vweights = [max(1, round(w / wmax * SCALE)) for w in work]
    opts = pymetis.Options(seed=seed, ufactor=ufactor)
    with c_stdout_silenced():
        _, part = pymetis.part_graph(
            parts, xadj=xadj, adjncy=adjncy, vweights=vweights, eweights=eweights, options=opts
        )
    return list(part)


@contextlib.contextmanager
def c_stdout_silenced():
    """METIS printf()s notes such as "Cannot bisect a graph with 0 vertices!" from C, on the
    process's stdout, where `--json` output goes: point file descriptor 1 at /dev/null
    meanwhile, flushing C's buffer before putting it back (the notes change nothing)."""
    libc = ctypes.CDLL(None)
    if sys.stdout is not None:
        sys.stdout.flush()
    libc.fflush(None)
    saved = os.dup(1)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 1)
        yield
    finally:
        libc.fflush(None)
        os.dup2(saved, 1)
        os.close(saved)


def ranked(
    costs: NodeCosts, units: list[list[int]], part: list[int]
) -> tuple[list[int], list[int]]:
    """(stage of every node, GPU of every stage): parts ranked, stages pushed forward."""
    mass: dict[int, list[float]] = {}
    for k, u in enumerate(units):
        w = sum(costs.rec[i] for i in u) + 1e-12
        m = mass.setdefault(part[k], [0.0, 0.0])
        m[0] += w * k
        m[1] += w
    rank = {p: r for r, p in enumerate(sorted(mass, key=lambda p: (mass[p][0] / mass[p][1], p)))}
    stage_of = [0] * costs.n
    for k, u in enumerate(units):  # units are in topological order
        s = max([rank[part[k]]] + [stage_of[p] for i in u for p in costs.preds[i]])
        for i in u:
            stage_of[i] = s
    return stage_of, list(range(len(rank)))


def split(
    costs: NodeCosts, units: list[list[int]], part: list[int]
) -> tuple[list[list[int]], list[int]]:
    """Runs of one part along a topological order that prefers to stay on the current part.

    Runs of a topological order form an acyclic partition, whatever METIS returned; the
    preference keeps the number of runs (stages) low. Returns (blocks, GPU of each block).
    """
    unit_of = {i: k for k, u in enumerate(units) for i in u}
    succ = [set() for _ in units]
    indeg = [0] * len(units)
    for k, u in enumerate(units):
        for i in u:
            for j in costs.succs[i]:
                m = unit_of[j]
                if m != k and m not in succ[k]:
                    succ[k].add(m)
                    indeg[m] += 1
    ready = {}  # part -> heap of ready units by position
    for k in range(len(units)):
        if not indeg[k]:
            heapq.heappush(ready.setdefault(part[k], []), k)
    blocks: list[list[int]] = []
    gpu: list[int] = []
    cur = None
    while any(ready.values()):
        if cur is None or not ready.get(cur):
            cur = min((h[0], p) for p, h in ready.items() if h)[1]
            blocks.append([])
            gpu.append(cur)
        k = heapq.heappop(ready[cur])
        blocks[-1].extend(units[k])
        for m in succ[k]:
            indeg[m] -= 1
            if not indeg[m]:
                heapq.heappush(ready.setdefault(part[m], []), m)
    return blocks, gpu
