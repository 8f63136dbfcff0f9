"""The planner: which shape (replicas x depth), micro-batch, schedule and recompute to run.

    found = plan_shape(graph_for, cluster, Space(batch=40, schedules=("ftpipe", "2bw")))
    found.plan, found.sim, found.candidate, found.rows

A candidate is one point of the search space: d replicas of a p-GPU pipeline (d x p = the
cluster's GPUs), micro-batches of b sequences, m of them per replica and step (d x b x m =
the global batch, kept fixed so every candidate trains the same way), a schedule, and
recompute or not. Each is judged by `best_for_candidate` (as `ftpipe compile` judges one
pipeline): every competing partitioner cuts the pipeline, every cut is placed in each
orientation the cluster allows and simulated with its replicas, the most samples/s that fit
win.

Candidates of one shape (d, p, b, m) differ by schedule and recompute only, and are searched
together, as `ftpipe compile` searches one pipeline's schedules (planner/matrix.py): the
cheap partitioners (`matrix.CHEAP`) cut every candidate, and the others only the `width`
candidates whose cheap plans simulate fastest (those with a placement pattern too, where
they say n/a at once); the rest keep their cheap plans, marked so. Shapes are taken best
bound first (`bounds.throughput_bound`); a candidate whose bound is not above the best plan
found so far by more than the `gap` is pruned, with its bound in the table: the plan chosen
is within `gap` of every candidate left unexplored (as a MIP solver's relative gap). Graphs
of other micro-batch sizes are traced when a bound first needs them. The cells (a
candidate, a partitioner) run in a process per core (`matrix.CellPool`); the search is the
same whatever the number.

*Effective speedup* (`effective_speedup`): the plan's simulated samples/s over those of
one GPU doing the same computation alone, the plan's forward, backward and recompute
back to back with no transfers, bubbles or all-reduce: how many GPUs' worth of work the
plan keeps busy, at most the number of GPUs. `useful` counts forward and backward only,
charging recompute as overhead too.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace

from tqdm import tqdm

from ..costs.cluster import Cluster
from ..costs.formulas import PRECISIONS
from ..errors import FtpipeError, InfeasibleError, unknown
from ..partition import PARTITIONERS, SPLIT, Problem, run_partitioner
from ..plan import Plan
from ..simulate import SimResult, simulate
from .bounds import throughput_bound
from .matrix import CHEAP, SLOWEST_FIRST, CellPool, kept_sim, split_keys
from .offload import choose_offload, shard_refusal
from .shapes import depths, orientations, placement

__all__ = [
    "Candidate",
    "Found",
    "Row",
    "Space",
    "best_for_candidate",
    "effective_speedup",
    "per_replica",
    "plan_shape",
]


@dataclass(frozen=True)
class Space:
    """What the planner may choose from; a fixed value is a one-element choice."""

    batch: int  # sequences per optimizer step, all replicas together
    micro_batch_sizes: tuple[int, ...] = ()  # () : the graph's own
    schedules: tuple[str, ...] = ("ftpipe",)
    recompute: tuple[bool, ...] = (True,)
    replicas: int | None = None  # None: any width
    micro_batches: int | None = None  # per replica and step; None: batch / (d x b)
    partitioners: tuple[str, ...] | None = None  # None: all
    optimizer: str = "adamw"
    seed: int = 0
    steps: int = 20  # simulated per plan
    gap: float = 0.05
    width: int = 1  # candidates of a shape the slower partitioners cut (compile's --search-width)
    workers: int | None = None  # processes (None: one per core)
    # Sharding optimizer state across replicas (planner/offload.py's SHARD_MODES): none
    # unless asked (`ftpipe compile` asks auto), nor where the update rule cannot shard.
    shard: str = "none"

    @property
    def sharding(self) -> str:
        """`shard`, or none where the runtime would refuse it (`offload.shard_refusal`)."""
        return "none" if shard_refusal(self.optimizer) else self.shard


@dataclass(frozen=True)
class Candidate:
    replicas: int
    gpus: int  # per replica
    micro_batch: int
    micro_batches: int  # per replica and step
    schedule: str
    recompute: bool

    @property
    def label(self) -> str:
        rec = "" if self.recompute else ", no recompute"
        return (
            f"{self.replicas} x {self.gpus}, {self.micro_batches} x {self.micro_batch}, "
            f"{self.schedule}{rec}"
        )


@dataclass(frozen=True)
class Row:
    """What became of one candidate."""

    candidate: Candidate
    bound: float  # samples/s no plan of it beats (0: does not fit)
    status: str  # chosen, simulated, pruned, no memory, infeasible
    partitioner: str = ""
    orientation: str = ""
    samples_per_s: float = 0.0
    effective_speedup: float = 0.0
    seconds: float = 0.0
    error: str = ""
    note: str = ""  # e.g. why the slower partitioners did not cut it

    def to_json(self) -> dict:
        return {
            **asdict(self.candidate),
            **{k: v for k, v in asdict(self).items() if k != "candidate"},
        }


@dataclass(frozen=True)
class Found:
    plan: Plan
    sim: SimResult
    candidate: Candidate
    rows: tuple[Row, ...]
    seconds: float
    trace_seconds: float
    competitors: tuple[dict, ...] = field(default=())  # the winner's partitioners, as compile's

    def to_json(self) -> dict:
        c = self.candidate
        return {
            "replicas": c.replicas,
            "gpus_per_replica": c.gpus,
            "micro_batch": c.micro_batch,
            "micro_batches": c.micro_batches,
            "batch": c.replicas * c.micro_batches * c.micro_batch,
            "schedule": c.schedule,
            "recompute": c.recompute,
            "partitioner": self.plan.partitioner,
            "placement": [list(x) for x in self.plan.placed()],
            "samples_per_s": self.sim.samples_per_s,
            "effective_speedup": effective_speedup(self.plan, self.sim),
            "useful_speedup": effective_speedup(self.plan, self.sim, useful=True),
            "planning_seconds": self.seconds,
            "trace_seconds": self.trace_seconds,
            "candidates": [r.to_json() for r in self.rows],
        }


def effective_speedup(plan: Plan, sim: SimResult, useful: bool = False) -> float:
    """Samples/s of the plan over samples/s of one GPU running the same work back to back
    (see the module docstring); `useful`: forward and backward only."""
    policies = plan.policies
    work = sum(
        s.fwd_s + s.bwd_s if useful else s.work_s(policies[s.id].recompute) for s in plan.stages
    )
    size = int(plan.model.get("micro_batch", 1))
    return sim.samples_per_s * work / size if work > 0 else 0.0


def best_for_candidate(problem: Problem, candidate: Candidate, cluster: Cluster, space: Space,
                       cut: Callable[[str], tuple] | None = None):  # fmt: skip
    """The fastest fitting (plan, simulation, partitioner rows) of one candidate: every
    partitioner's cut, replicated and placed in each orientation, simulated. None: no fit.
    `cut(partitioner)`: a partitioner's `cut_candidate`, made already (or not: None), the
    plan kept checked by the caller; without it, every cut is made here and the plan kept
    simulated again here (`matrix.kept_sim`)."""
    best, rows = None, []
    for name in _partitioners(space):
        got = cut(name) if cut else cut_candidate(problem, candidate, cluster, space, name)
        if got is None:
            continue
        row, fastest = got
        if fastest and (best is None or fastest[1].samples_per_s > best[1].samples_per_s):
            best = fastest
        rows.append(row)
    if best is not None and cut is None:
        best = (best[0], kept_sim(best[0], space.steps), *best[2:])
    return best, tuple(rows)


def cut_candidate(problem: Problem, candidate: Candidate, cluster: Cluster, space: Space,
                  partitioner: str, parts: list | None = None) -> tuple[dict, tuple | None]:  # fmt: skip
    """One partitioner's cut of the candidate, replicated and placed in each orientation the
    cluster allows, each stage's optimizer state sharded across the replicas as
    `space.shard` says (`offload.choose_offload`), simulated: (its row, (plan, simulation,
    orientation) of the fastest that fits, or None). Under `auto` the cut counting every
    stage's state whole comes first, and the one counting it sharded (`problem.shard_over`)
    only when that fits nowhere: a plan that shards never displaces one that need not.
    `parts`: the partitioner's `SPLIT` parts of the problem, made already (one problem only)."""
    if space.sharding == "auto" and problem.shard_over > 1:
        row, best = _placed(replace(problem, shard_over=1), candidate, cluster, space, partitioner)
        if best is not None:
            return row, best
    return _placed(problem, candidate, cluster, space, partitioner, parts)


def _placed(problem: Problem, candidate: Candidate, cluster: Cluster, space: Space,
            partitioner: str, parts: list | None = None) -> tuple[dict, tuple | None]:  # fmt: skip
    r = run_partitioner(problem, partitioner, parts)
    if r.feasible and r.plan.gpus < candidate.gpus:
        # A cut that leaves GPUs idle (`Plan.compacted`) is no plan of this shape: its ranks
        # would not fill the cluster, and the runtime launches every one of them.
        idle = candidate.gpus - r.plan.gpus
        r = replace(r, feasible=False, error=f"{partitioner}: leaves {idle} of the "
                    f"{candidate.gpus} GPUs of a pipeline without a stage")  # fmt: skip
    row, best = r.to_json(), None
    if r.feasible:
        for o in orientations(cluster, candidate.replicas, candidate.gpus):
            plan = r.plan.with_(
                replicas=candidate.replicas,
                placement=placement(candidate.replicas, candidate.gpus, o),
                cluster=cluster,
                recompute=candidate.recompute,
            )
            plan = choose_offload(plan, "none", shard=space.sharding)
            # the chosen one simulated again, its lists checked (`kept_sim`)
            sim = simulate(plan, steps=space.steps, checked=False, steady=True)
            if sim.fits and (best is None or sim.samples_per_s > best[1].samples_per_s):
                best = (plan, sim, o)
            if sim.samples_per_s > (row.get("simulated_samples_per_s") or 0):
                row.update(simulated_step_time_s=sim.step_time_s,
                           simulated_samples_per_s=sim.samples_per_s, orientation=o)  # fmt: skip
    return row, best


def _partitioners(space: Space) -> list[str]:
    names = list(PARTITIONERS) if space.partitioners is None else list(space.partitioners)
    for n in names:
        if n not in PARTITIONERS:
            raise unknown("partitioner", n, PARTITIONERS)
    return names


def per_replica(batch: int, replicas: int, micro_batch: int) -> int | None:
    """Micro-batches of `micro_batch` sequences each of `replicas` runs a step to train
    `batch` together; None when the batch does not split into whole ones (that width is
    not a candidate)."""
    m, rest = divmod(batch, replicas * micro_batch)
    return None if rest else m


def candidates(cluster: Cluster, space: Space, sizes: tuple[int, ...]) -> list[Candidate]:
    out = []
    for p in depths(cluster, space.replicas):
        d = cluster.gpus // p
        for b in sizes:
            m = space.micro_batches or per_replica(space.batch, d, b)
            if m is None:
                continue
            for sched in space.schedules:
                for rec in space.recompute:
                    out.append(Candidate(d, p, b, m, sched, rec))
    return out


def _bounded(graph, cluster: Cluster, space: Space, sizes, hw):
    """Each candidate's problem and throughput bound; rows for those that cannot fit. The
    bounds are counted in the pool, a schedule's candidates together (its policies, counted
    from its action order at each depth and micro-batch count, are cached in a process):
    T5-11B's 126 candidates on 64 V100s took 3 s in one process, most of it ZB-V's and
    interleaved 1F1B's."""
    made = []  # (candidate, its problem or why it has none), in the candidates' order
    for c in candidates(cluster, space, sizes):
        try:
            g = graph(c.micro_batch)
            problem = Problem(
                g, c.gpus, hw, c.schedule, space.optimizer,
                micro_batches=c.micro_batches, seed=space.seed, recompute=c.recompute,
                link_bandwidth=cluster.intra_node.bandwidth, rematerialise=True,
                precision=PRECISIONS[(g.meta or {}).get("precision", "fp32")],  # as traced
                shard_over=c.replicas if space.sharding != "none" else 1,
            )  # fmt: skip
        except FtpipeError as e:  # too few micro-batches for the schedule, and the like
            made.append((c, str(e)))
            continue
        made.append((c, problem))
    posed = [(c, p) for c, p in made if isinstance(p, Problem)]

    def bounds(schedule: str) -> list[float]:
        return [throughput_bound(p, c.replicas, cluster, orientations(cluster, c.replicas, c.gpus))
                for c, p in posed if c.schedule == schedule]  # fmt: skip

    schedules = list(dict.fromkeys(c.schedule for c, _ in posed))
    with CellPool(bounds, space.workers) as pool:
        pool.want(schedules)
        got = {s: iter(pool.result(s)) for s in schedules}
    todo, rows = [], []
    for c, problem in made:
        if not isinstance(problem, Problem):
            rows.append(Row(c, 0.0, "infeasible", error=problem))
            continue
        bound = next(got[c.schedule])
        if bound <= 0:
            rows.append(
                Row(c, 0.0, "no memory", error="weights, gradients and state alone overflow")
            )
            continue
        todo.append((bound, c, problem))
    return todo, rows


def plan_shape(graph_for: Callable[[int], object], cluster: Cluster, space: Space, hardware=None,
               progress: bool = True) -> Found:  # fmt: skip
    """Search the space (see the module docstring). `graph_for(b)`: the costed graph traced
    with micro-batches of b (cached by the caller)."""
    t0 = time.perf_counter()
    traced = {"s": 0.0}

    def graph(b):
        t = time.perf_counter()
        g = graph_for(b)
        traced["s"] += time.perf_counter() - t
        return g

    sizes = space.micro_batch_sizes or (int(graph_for(None).meta.get("micro_batch", 1)),)
    hw = hardware or cluster.gpu
    todo, rows = _bounded(graph, cluster, space, sizes, hw)
    names = _partitioners(space)
    search = _Search(todo, cluster, space, names)
    bar = tqdm(total=len(todo), desc="planning", file=sys.stderr,
               disable=None if progress else True, leave=False)  # fmt: skip
    with CellPool(search.cut, space.workers) as pool:
        for i, shape in enumerate(search.shapes):
            rows += search.shape(pool, shape, search.shapes[i + 1 : i + 2], bar)
    bar.close()
    if search.best is None:
        why = "; ".join(f"{r.candidate.label}: {r.error}" for r in rows if r.error)[:500]
        raise InfeasibleError(f"no shape of {cluster.gpus} GPUs fits: {why or 'nothing to try'}")
    plan, _, k = search.best
    sim = kept_sim(plan, space.steps)
    chosen, competitors = search.todo[k][1], search.competitors[k]
    rows = [
        Row(**{**r.__dict__, "status": "chosen"})
        if r.candidate == chosen and r.status == "simulated"
        else r
        for r in rows
    ]
    rows.sort(key=lambda r: (-r.samples_per_s, -r.bound))
    return Found(plan, sim, chosen, tuple(rows), time.perf_counter() - t0, traced["s"], competitors)


class _Search:
    """The shapes' candidates, best bound first, and the best plan found so far. A cell is
    (candidate's position, partitioner); `cut` makes one (in a worker)."""

    def __init__(self, todo: list, cluster: Cluster, space: Space, names: list[str]):
        self.cluster, self.space, self.names = cluster, space, names
        # Best bound first; among equal bounds the cheaper partitioning (fewer GPUs per
        # pipeline), then the larger micro-batch, the schedule's name, recompute first.
        todo = sorted(
            todo,
            key=lambda x: (-x[0], x[1].gpus, -x[1].micro_batch, x[1].schedule, not x[1].recompute),
        )
        self.todo = todo
        shapes: dict[tuple, list[int]] = {}
        for k, (_, c, _) in enumerate(todo):
            shapes.setdefault((c.replicas, c.gpus, c.micro_batch, c.micro_batches), []).append(k)
        self.shapes = list(shapes.values())  # in the order of their best bounds
        self.cheap = [n for n in names if n in CHEAP]
        self.costly = sorted((n for n in names if n not in CHEAP), key=_slowest_first)
        self.best = None  # (plan, sim, candidate's position) of the fastest so far
        self.competitors: dict[int, tuple] = {}  # candidate's position -> its partitioners' rows

    def cut(self, key: tuple) -> tuple[dict, tuple | None]:
        """A cell: (candidate's position, partitioner) cut and simulated, or one part of a
        `SPLIT` partitioner's search (`_keys`)."""
        _, c, problem = self.todo[key[0]]
        if len(key) == 4:
            return SPLIT[key[1]][0](problem, key[2], key[3])
        return cut_candidate(problem, c, self.cluster, self.space, key[1])

    def _keys(self, pool: CellPool, k: int, p: str) -> list[tuple]:
        """The pool's cells that make candidate k's cut by p: in parts (`split_keys`) where
        the cut has one problem (sharding under `auto` may cut a second)."""
        problem = self.todo[k][2]
        if self.space.sharding == "auto" and problem.shard_over > 1:
            return [(k, p)]
        return split_keys((k, p), problem, pool.parts)

    def _result(self, pool: CellPool, k: int, p: str):
        """Candidate k's cut by p, its parts joined here where it was made in parts."""
        _, c, problem = self.todo[k]
        return pool.joined((k, p), self._keys(pool, k, p),
                           lambda parts: cut_candidate(problem, c, self.cluster, self.space, p, parts))  # fmt: skip

    def _pruned(self, k: int) -> bool:
        bound = self.todo[k][0]
        return self.best is not None and bound <= self.best[1].samples_per_s * (1 + self.space.gap)

    def shape(self, pool: CellPool, ks: list[int], after: list[list[int]], bar) -> list[Row]:
        """The rows of one shape's candidates, best bound first: pruned, or cut by the cheap
        partitioners, and the fastest `width` of them by the others too. While the slower
        cuts run, the next shape's best tier's cheap ones are wanted ahead (dropped if pruned
        when their turn comes), and its slower ones where they are known, so that every core
        works."""
        quick = {}
        for tier in _tiers(ks, lambda k: self.todo[k][0]):  # equal bounds: wanted together
            pool.want([(k, p) for k in tier if not self._pruned(k) for p in self.cheap])
            for k in tier:  # a plan found prunes the candidates after it
                if self._pruned(k):
                    for p in self.names:
                        for key in self._keys(pool, k, p):
                            pool.drop(key)
                    continue
                quick[k] = best_for_candidate(*self._args(k), self._cuts(pool, k, self.cheap))
                self._offer(k, *quick[k])
        live = list(quick)
        likely = self._deep(live, quick)
        deep = [k for k in likely if not self._pruned(k)]
        slow = sorted(
            (key for k in deep for p in self.costly for key in self._keys(pool, k, p)),
            key=lambda c: _slowest_first(c[1]),
        )
        pool.want(slow, first=True)
        # Only the next shape's best tier: its later tiers are often pruned by the plans this
        # shape is about to give (T5-11B on 64 V100s: 2 x 32's candidates, cut ahead and then
        # pruned, were 20 of 140 CPU seconds).
        ahead = [k for ks_ in after for k in _tiers(ks_, lambda k: self.todo[k][0])[0]]
        ahead = [k for k in ahead if not self._pruned(k)]
        pool.want([(k, p) for k in ahead for p in self.cheap])
        if pool.ahead and after and self._settled(after[0]):
            # Where the next shape's later tiers are pruned already, its slower cuts are
            # those its best tier's cheap plans choose, as they will when its turn comes
            # (unless this shape's plans prune them: then they were cut for nothing).
            cheap = {k: best_for_candidate(*self._args(k), self._cuts(pool, k, self.cheap))
                     for k in ahead}  # fmt: skip
            guess = self._deep(ahead, cheap)
            pool.want([key for k in guess for p in self.costly for key in self._keys(pool, k, p)])
        out = []
        for k in ks:
            bound, c, _ = self.todo[k]
            if k not in live:
                out.append(Row(c, bound, "pruned"))
                bar.update()
                continue
            t = time.perf_counter()
            names = self.names if k in deep else self.cheap
            got, competitors = best_for_candidate(*self._args(k), self._cuts(pool, k, names))
            if k not in deep:
                competitors += tuple(_not_cut(p) for p in self.costly)
            note = "" if k in deep else _NOTES[k in likely]
            out.append(self._row(k, got, competitors, time.perf_counter() - t, note))
            self._offer(k, got, competitors)
            bar.update()
        return out

    def _settled(self, ks: list[int]) -> bool:
        """Are a shape's candidates after its best tier all pruned by the best plan so far?"""
        later = _tiers(ks, lambda k: self.todo[k][0])[1:]
        return all(self._pruned(k) for tier in later for k in tier)

    def _deep(self, live: list[int], quick: dict) -> list[int]:
        """The candidates the slower partitioners cut: the `width` whose cheap plans simulate
        fastest among those placed freely, and those with a placement pattern (n/a at once)."""
        free = [k for k in live if not self.todo[k][2].patterned]
        ranked = sorted(free, key=lambda k: _promise(quick[k][0]))[: self.space.width]
        return [k for k in live if k in ranked or self.todo[k][2].patterned]

    def _args(self, k: int) -> tuple:
        bound, c, problem = self.todo[k]
        return problem, c, self.cluster, self.space

    def _cuts(self, pool: CellPool, k: int, names: list[str]):
        """The cells of candidate k for best_for_candidate: these partitioners', in order."""
        wanted = set(names)
        return lambda p: self._result(pool, k, p) if p in wanted else None

    def _offer(self, k: int, got, competitors) -> None:
        """Candidate k's fastest plan so far (its cheap cuts, then all its cuts)."""
        self.competitors[k] = competitors
        if got is None:
            return
        plan, sim, _ = got
        if self.best is None or sim.samples_per_s > self.best[1].samples_per_s:
            self.best = (plan, sim, k)

    def _row(self, k: int, got, competitors, seconds: float, note: str) -> Row:
        bound, c, _ = self.todo[k]
        if got is None:
            why = "; ".join(x.get("error", "") for x in competitors if x.get("error"))
            return Row(c, bound, "infeasible", seconds=seconds,
                       error=(why or "nothing fits")[:300], note=note)  # fmt: skip
        plan, sim, orientation = got
        return Row(c, bound, "simulated", plan.partitioner, orientation, sim.samples_per_s,
                   effective_speedup(plan, sim), seconds, note=note)  # fmt: skip


_NOTES = {  # why the slower partitioners did not cut a candidate (ranked in the width or not)
    False: "cut by the cheap partitioners only: others of its shape ranked first (--search-width)",
    True: "cut by the cheap partitioners only: its bound is within the gap of the best plan",
}


def _tiers(ks: list[int], bound) -> list[list[int]]:
    """Consecutive candidates of equal bound, together."""
    out: list[list[int]] = []
    for k in ks:
        if out and bound(out[-1][0]) == bound(k):
            out[-1].append(k)
        else:
            out.append([k])
    return out


def _promise(got) -> tuple[float, int]:
    """How likely the slower partitioners improve a candidate, most likely first: its cheap
    plans' samples/s, then the least memory on the fullest GPU. Schedules that time a cut
    alike (FTPipe's and PipeDream-2BW's) tie on samples/s; the one keeping fewer weight
    versions leaves the balanced cuts room to fit. T5-11B on 4 x 16 V100s at 2,560 sequences
    a step, `--schedule ftpipe,2bw`: 2BW won the tie by its name, its slower cuts gained
    nothing and 10.76 samples/s was chosen; FTPipe's Mixed-pipe cut gives 18.05 (effective
    speedup 62.0)."""
    if not got:
        return (0.0, 0)
    return (-round(got[1].samples_per_s, 9), got[1].max_memory_bytes)


def _slowest_first(p: str) -> int:
    return SLOWEST_FIRST.index(p) if p in SLOWEST_FIRST else len(SLOWEST_FIRST)


def _not_cut(partitioner: str) -> dict:
    return {
        "partitioner": partitioner,
        "feasible": False,
        "error": f"{partitioner}: not searched (its cheap plans ranked this candidate out)",
        "search_seconds": 0.0,
    }
