"""Freeze training on an elastic pipeline, simulated: PipeTransformer (He et al., ICML'21).

    run = FreezeRun(alpha=1/3, epochs=3, samples=87_599, batch=64, depth=8)
    got = simulate_freezing(graph, cluster, run)           # graph: op granularity, costed
    got.seconds, got.baseline_seconds, got.speedup, got.intervals

The run is cut into intervals (`decisions_per_epoch` per epoch); before each but the first,
the freeze rule (`ftpipe_runtime.freeze.layers`, §3.1) raises the frozen count. The gradient
term of the rule needs real gradients, so the simulation takes the bound as what limits:
the most freezing alpha allows, the best case for speed. For each interval:

- AutoPipe / AutoDP (§3.2-3.3): the graph with the frozen prefix (`frozen_graph`: frozen
  parameters have no gradient or optimizer state, frozen ops no backward and keep no
  activations) is planned on pipelines of K, K/2, K/4 ... GPUs, the freed GPUs running
  data-parallel replicas (`best_for_candidate`: every partitioner, every orientation,
  simulated with the replicas' all-reduce); the fastest that fits is taken. Each replica keeps `batch`
  sequences per step, as PipeTransformer's pipelines keep theirs when AutoDP adds replicas.
  The frozen prefix runs forward only where the partitioner puts it, always at the head of
  the chain (PipeTransformer pins it to the first GPU).
- AutoCache (§3.4): the frozen prefix's output of each sample may be cached (host memory,
  disk past `CacheOptions.host_bytes` per node) and read back next interval instead of
  running the prefix; an interval that freezes more runs only the layers frozen since the
  cache was written and writes the new boundary. Reading and writing are charged to the
  boundary's ops (`cached_graph`). Whether and when to cache is chosen by the simulator
  (a small dynamic programme over what the cache holds), so it is used only where it pays.

The first interval runs on pipelines of K GPUs, as PipeTransformer's T0; the baseline is
the whole training without freezing on that shape (the paper's PyTorch Pipe + DDP), and
`best_no_freeze` the whole training on the fastest of the same depths without freezing
(a harder baseline: the shape ftpipe's planner would choose).
"""

from __future__ import annotations

import functools
from dataclasses import asdict, dataclass, replace

from ftpipe_runtime.freeze.layers import bound_schedule

from ..costs.cluster import Cluster
from ..costs.formulas import PRECISIONS
from ..errors import FtpipeError, InfeasibleError
from ..graph.granularity import collapse
from ..graph.opgraph import OpGraph
from ..partition import Problem
from .frozen_graphs import boundary_bytes, cached_graph, frozen_graph, graph_units
from .search import Candidate, Space, best_for_candidate

__all__ = [
    "CacheOptions",
    "Elastic",
    "FreezeRun",
    "Interval",
    "Shape",
    "simulate_freezing",
]


@dataclass(frozen=True)
class FreezeRun:
    alpha: float
    epochs: int
    samples: int  # per epoch
    batch: int  # sequences per replica and step
    depth: int  # K: GPUs per pipeline before anything is frozen
    decisions_per_epoch: int = 1
    schedule: str = "gpipe"
    optimizer: str = "adam"
    partitioners: tuple[str, ...] | None = None  # None: all
    steps: int = 6  # simulated per plan


@dataclass(frozen=True)
class CacheOptions:
    host_bytes: float = 64 * 2**30  # per node, for cached activations
    host_bandwidth: float = 0.0  # host memory -> one GPU; 0: the node's GPU link
    disk_bandwidth: float = 2e9  # per node, shared by its GPUs


@dataclass(frozen=True)
class Shape:
    """The plan of one interval: replicas x depth, and what it simulates to."""

    replicas: int
    depth: int
    partitioner: str
    samples_per_s: float
    step_time_s: float


@dataclass(frozen=True)
class Interval:
    index: int
    epoch: float  # where it starts
    frozen: int  # layers
    shape: Shape
    cache_read: int | None  # frozen layers whose output is read from the cache
    cache_write: int | None  # the boundary written (None: nothing)
    cache_bytes_per_node: float
    seconds: float
    no_cache_seconds: float


@dataclass(frozen=True)
class Elastic:
    run: FreezeRun
    layers: int
    intervals: tuple[Interval, ...]
    baseline: Shape
    best_no_freeze: Shape
    no_cache_seconds: float  # the same freezing without AutoCache

    @property
    def seconds(self) -> float:
        return sum(i.seconds for i in self.intervals)

    def time_of(self, shape: Shape) -> float:
        return self.run.epochs * self.run.samples / shape.samples_per_s

    @property
    def baseline_seconds(self) -> float:
        return self.time_of(self.baseline)

    @property
    def speedup(self) -> float:
        return self.baseline_seconds / self.seconds

    @property
    def speedup_vs_best(self) -> float:
        return self.time_of(self.best_no_freeze) / self.seconds

    def to_json(self) -> dict:
        return {
            "run": asdict(self.run),
            "layers": self.layers,
            "intervals": [asdict(i) for i in self.intervals],
            "baseline": asdict(self.baseline),
            "best_no_freeze": asdict(self.best_no_freeze),
            "seconds": self.seconds,
            "baseline_seconds": self.baseline_seconds,
            "best_no_freeze_seconds": self.time_of(self.best_no_freeze),
            "no_cache_seconds": self.no_cache_seconds,
            "speedup": self.speedup,
            "speedup_vs_best": self.speedup_vs_best,
        }


def simulate_freezing(
    graph: OpGraph, cluster: Cluster, run: FreezeRun, cache: CacheOptions | None = CacheOptions()
) -> Elastic:
    """See the module docstring. `graph`: costed, op granularity, one micro-batch's costs;
    `cache=None`: no AutoCache."""
    units = graph_units(graph)
    micro = int(graph.meta.get("micro_batch", 1))
    if run.batch % micro:
        raise FtpipeError(f"the batch ({run.batch}) is not a multiple of the micro-batch {micro}")
    depths = [d for d in _halvings(run.depth) if cluster.gpus % d == 0]
    precision = PRECISIONS[graph.meta.get("precision", "fp32")]

    @functools.lru_cache(None)
    def frozen(layers: int) -> OpGraph:
        return frozen_graph(graph, frozenset(p for u in units[:layers] for p in u))

    @functools.lru_cache(None)
    def shape(layers: int, read=None, write=None, s_per_byte=0.0, only=None) -> Shape:
        """The fastest fitting plan of an interval (`only`: that depth alone)."""
        g = collapse(cached_graph(frozen(layers), units, read, write, s_per_byte))
        best = None
        for depth in [only] if only else depths:
            got = _fastest_at(g, depth, cluster, run, micro, precision)
            if got and (best is None or got.samples_per_s > best.samples_per_s):
                best = got
        if best is None:
            raise InfeasibleError(f"no pipeline of {depths} GPUs fits with {layers} frozen layers")
        return best

    n = run.epochs * run.decisions_per_epoch
    counts = (0, *bound_schedule(len(units), run.alpha, n - 1))
    per = run.samples / run.decisions_per_epoch
    link = (cache.host_bandwidth or cluster.intra_node.bandwidth) if cache else 0.0

    def cost(layers: int) -> tuple[float, float]:
        """(seconds per cached byte, cache bytes per node) of the boundary after `layers`:
        what does not fit in host memory is read from the node's disk, which its GPUs share."""
        held = boundary_bytes(frozen(layers), units, layers) / micro * run.samples / cluster.nodes
        in_host = min(1.0, cache.host_bytes / held) if held else 1.0
        disk = cache.disk_bandwidth / min(cluster.gpus, cluster.gpus_per_node)
        return in_host / link + (1 - in_host) / disk, held

    intervals = _cheapest(counts, run, per, shape, cost if cache else None)
    return Elastic(
        run,
        len(units),
        intervals,
        shape(0, only=run.depth),
        shape(0),
        sum(i.no_cache_seconds for i in intervals),
    )


def _fastest_at(g: OpGraph, depth: int, cluster: Cluster, run: FreezeRun, micro: int, precision):
    """The fastest fitting plan of pipelines `depth` GPUs deep (None: nothing fits)."""
    c = Candidate(cluster.gpus // depth, depth, micro, run.batch // micro, run.schedule, True)
    space = Space(batch=c.replicas * run.batch, schedules=(run.schedule,),
                  optimizer=run.optimizer, partitioners=run.partitioners,
                  steps=run.steps)  # fmt: skip
    try:
        problem = Problem(g, depth, cluster.gpu, run.schedule, run.optimizer,
                          micro_batches=c.micro_batches, recompute=True,
                          link_bandwidth=cluster.intra_node.bandwidth,
                          rematerialise=True, precision=precision)  # fmt: skip
    except FtpipeError:
        return None
    got, _ = best_for_candidate(problem, c, cluster, space)
    if not got:
        return None
    plan, sim, _ = got
    return Shape(c.replicas, depth, plan.partitioner, sim.samples_per_s, sim.step_time_s)


def _cheapest(counts, run: FreezeRun, per: float, shape, cost) -> tuple[Interval, ...]:
    """The intervals of least total time: `shape(layers, read, write, s_per_byte, only)` is
    an interval's plan, `cost(layers)` the cache's (None: no AutoCache)."""
    # Dynamic programme over what the cache holds: the boundary after c layers, or nothing.
    states: dict = {None: (0.0, ())}
    for i, ell in enumerate(counts):
        plain = shape(ell, only=run.depth if i == 0 else None)  # T0: the paper's K
        nxt: dict = {}
        for held, (total, path) in states.items():
            options = [(held, Interval(i, i / run.decisions_per_epoch, ell, plain, None, None,
                                       0.0, per / plain.samples_per_s,
                                       per / plain.samples_per_s))]  # fmt: skip
            if cost and ell:
                spb, nbytes = cost(ell)
                write = ell if ell != held else None
                sh = shape(ell, held, write, spb)
                options.append((ell, replace(options[0][1], shape=sh, cache_read=held,
                                             cache_write=write, cache_bytes_per_node=nbytes,
                                             seconds=per / sh.samples_per_s)))  # fmt: skip
            for new, row in options:
                if new not in nxt or total + row.seconds < nxt[new][0]:
                    nxt[new] = (total + row.seconds, (*path, row))
        states = nxt
    return min(states.values(), key=lambda v: v[0])[1]


def _halvings(k: int) -> list[int]:
    out = []
    while k >= 1:
        out.append(k)
        k //= 2
    return out
