"""Merging the streams of stages that share a GPU into one list per GPU that cannot deadlock.

    lists = interleave(stages, {stage: its own actions}, step_groups, priority)

A GPU hosting one stage runs that stage's stream as it is. With several stages per GPU
(Mixed-pipe's free placement, WPipe's two groups) the order comes from executing all stages
with idealised durations (forward 1, backward 2, recompute 1 more): an idle GPU takes the
ready head action its schedule's `priority` ranks first, and each GPU's actions are sorted
by their idealised start. A schedule may offer several priorities: the one whose idealised
run ends first is kept (ties: the first offered), still a pure function of the streams.
"""

from __future__ import annotations

import heapq
from typing import TYPE_CHECKING

from ..errors import ScheduleError
from .actions import Action

if TYPE_CHECKING:  # base.py imports this module: a Schedule's default priority is here
    from .base import StageInfo

__all__ = ["assumed_edges", "backward_first", "duration", "interleave"]

# Idealised durations for ordering only: a backward costs about two forwards, recompute one
# more; split in two (zero-bubble), B and W one each.
_UNIT = {"F": 1, "B": 2, "W": 1, "S": 0}


_RANK = {"B": 0, "F": 1, "W": 2}  # W last: it is what fills a GPU's idle time


def backward_first(a: Action, st: StageInfo) -> tuple:
    """Merge priority: backwards (they free memory and unblock upstream), then forwards, then
    weight-gradient passes; then the oldest micro-batch, then the lower stage."""
    return (_RANK.get(a.kind, 1), a.mb, st.id)


def _reduced(deps: dict[int, set[int]]) -> dict[int, list[int]]:
    """Drop implied dependencies (the relation is transitive): waiting for the nearest suffices."""
    return {s: sorted(d - {x for y in d for x in deps[y]}) for s, d in deps.items()}


def assumed_edges(stages: list[StageInfo]) -> tuple[dict[int, list[int]], dict[int, list[int]]]:
    """(producers, consumers) of every stage when the real edges are unknown: every lower-id
    stage of greater depth (a superset of the real edges: those always go to a lower depth),
    with implied dependencies dropped."""
    producers = _reduced(
        {s.id: {p.id for p in stages if p.id < s.id and p.depth > s.depth} for s in stages}
    )
    consumers = _reduced(
        {s.id: {c.id for c in stages if c.id > s.id and c.depth < s.depth} for s in stages}
    )
    return producers, consumers


def duration(a: Action, split: bool = False) -> int:
    """Idealised duration of an action, for ordering only (`split`: its B is input-only)."""
    return _unit(a.kind, split) + a.recompute


def _unit(kind: str, split: bool) -> int:
    return _UNIT[kind] - (split and kind == "B")


def interleave(
    stages: list[StageInfo], per_stage: dict[int, list[Action]], sync=(), priority=backward_first
) -> dict[int, list[Action]]:
    """Merge the stages' action lists into one list per GPU that cannot deadlock; `priority`
    is one function (action, stage) -> sort key, or a tuple of them to choose from."""
    gpus = [s.gpu for s in stages]
    if len(set(gpus)) == len(gpus):  # one stage per GPU: its stream is the GPU's list
        return {s.gpu: list(per_stage[s.id]) for s in sorted(stages, key=lambda s: s.gpu)}
    candidates = priority if isinstance(priority, tuple) else (priority,)
    runs = [_merge(stages, per_stage, sync, p) for p in candidates]
    return min(runs, key=lambda run: run[1])[0]


def _merge(stages, per_stage, sync, priority) -> tuple[dict[int, list[Action]], int]:
    """One list per GPU by idealised list scheduling, and when that idealised run ends.

    Stage edges are not known here, so a stage is assumed to depend on every lower-id stage
    of greater depth (a superset of the real edges: those always go to a lower depth). Every
    dependency then starts strictly earlier and a synchronised step has one start and one
    key on all its GPUs, so the per-GPU orders follow one global order; executing them in
    order with any durations always finds the globally first pending action runnable.
    """
    run = _Ideal(stages, per_stage, sync, priority)
    while run.left:
        run.take_steps()
        run.dispatch()
        run.advance()
    lists = {
        g: [row[-1] for row in sorted(rows, key=lambda r: r[:5])]
        for g, rows in sorted(run.keyed.items())
    }
    return lists, max(run.gpu_free.values(), default=0)


class _Ideal:
    """The state of one idealised run (`_merge`): time `t`, each stage's next action, when
    each action ended, and each GPU's actions keyed by their start. A head action's inputs
    are looked at when it becomes the head and, while one has not started, when that one
    starts: then it is known when the head may start (`soon`, then `now` on its GPU)."""

    def __init__(self, stages, per_stage, sync, priority):
        self.info = {s.id: s for s in stages}
        self.per_stage, self.priority = per_stage, priority
        self.split = {s for s, acts in per_stage.items() if any(a.kind == "W" for a in acts)}
        # `duration` of each kind on each stage, without its recompute
        self.units = {s: {k: _unit(k, s in self.split) for k in _UNIT} for s in per_stage}
        self.producers, self.consumers = assumed_edges(stages)
        self.on_gpu: dict[int, list[int]] = {}
        for s in stages:
            self.on_gpu.setdefault(s.gpu, []).append(s.id)
        self.group_of = {s: tuple(g) for g in sync for s in g}
        self.end = {k: {s: {} for s in self.info} for k in "FBW"}  # kind -> stage -> mb -> end
        self.pos = dict.fromkeys(self.info, 0)
        self.heads = {s: (self.per_stage[s] or [None])[0] for s in self.info}  # next actions
        self.order = {s: k for k, s in enumerate(self.info)}
        self.stepping = {s for s, a in self.heads.items() if a is not None and a.kind == "S"}
        self.gpu_free = dict.fromkeys(self.on_gpu, 0)
        self.arrived: dict[tuple, set[int]] = {}  # (group, step) -> stages waiting at that step
        self.keyed: dict[int, list[tuple]] = {g: [] for g in self.on_gpu}
        self.left = sum(len(v) for v in per_stage.values())
        self.times: list[int] = []
        self.t = 0
        self.soon: dict[int, list] = {g: [] for g in self.on_gpu}  # heaps of (may start, stage)
        self.now: dict[int, set[int]] = {g: set() for g in self.on_gpu}  # heads that may start
        self.blocked: dict[tuple, list[int]] = {}  # (kind, stage, mb) -> heads waiting on it
        self.rank: dict[int, tuple] = {}  # stage -> (its armed head's priority, stage)
        # What a head of each kind waits for, per stage: (kind, stage) of each input and the
        # dict its end lands in (made once: a run arms a head for every action it takes).
        end = self.end
        self.needs = {
            "F": {s: [(("F", d), end["F"][d]) for d in self.producers[s]] for s in self.info},
            "B": {
                s: [*((("B", d), end["B"][d]) for d in self.consumers[s]), (("F", s), end["F"][s])]
                for s in self.info
            },
            "W": {s: [(("B", s), end["B"][s])] for s in self.info},
        }
        for s in self.info:
            self._arm(s)

    def head(self, s: int) -> Action | None:
        return self.heads[s]

    def _next(self, s: int) -> None:
        """Stage s's head action is taken: the one after it is its head."""
        acts, at = self.per_stage[s], self.pos[s] + 1
        self.pos[s] = at
        a = self.heads[s] = acts[at] if at < len(acts) else None
        if a is not None and a.kind == "S":
            self.stepping.add(s)
        else:
            self.stepping.discard(s)
        self._arm(s)

    def _arm(self, s: int) -> None:
        """When stage s's head (not a step) may start: its inputs all ended, or the input not
        started yet that it waits on."""
        a = self.heads[s]
        if a is None:
            return
        kind, mb = a.kind, a.mb
        if kind == "S":
            return
        at = 0
        for (k, d), ends in self.needs[kind][s]:
            x = ends.get(mb)
            if x is None:
                self.blocked.setdefault((k, d, mb), []).append(s)
                return
            if x > at:
                at = x
        info = self.info[s]
        self.rank[s] = (self.priority(a, info), s)  # asked each time its GPU is idle
        heapq.heappush(self.soon[info.gpu], (at, s))

    def take_steps(self) -> None:
        """Steps cost no time; a synchronised one waits for its whole group."""
        t = self.t
        for s in sorted(self.stepping, key=self.order.__getitem__):  # the stages' order
            a = self.heads[s]  # (a group completed before it in this round may have moved it)
            if a is None or a.kind != "S" or self.gpu_free[self.info[s].gpu] > t:
                continue
            group = self.group_of.get(s, (s,))
            waiting = self.arrived.setdefault((group, a.mb), set())
            waiting.add(s)
            if len(waiting) == len(group):
                for member in group:
                    row = (t, 0, group[0], a.mb, member, self.heads[member])
                    self.keyed[self.info[member].gpu].append(row)
                    self._next(member)
                self.left -= len(group)

    def dispatch(self) -> None:
        """Every idle GPU starts the ready head action its priority ranks first."""
        t, heads, rank, free, end = self.t, self.heads, self.rank, self.gpu_free, self.end
        pop, push = heapq.heappop, heapq.heappush
        for g in self.on_gpu:
            if free[g] > t:
                continue
            soon, now = self.soon[g], self.now[g]
            while soon and soon[0][0] <= t:
                now.add(pop(soon)[1])
            if not now:
                continue
            s = min(map(rank.__getitem__, now))[1]
            now.discard(s)
            a = heads[s]
            kind, mb = a.kind, a.mb
            done = t + self.units[s][kind] + a.recompute  # `duration`, per stage made once
            free[g] = end[kind][s][mb] = done
            for waiting in self.blocked.pop((kind, s, mb), ()):
                self._arm(waiting)
            self.keyed[g].append((t, 1, s, mb, s, a))
            self._next(s)
            self.left -= 1
            push(self.times, done)

    def advance(self) -> None:
        """To the next time an action ends; nothing running with actions left: a deadlock."""
        times = self.times
        while times and times[0] <= self.t:
            heapq.heappop(times)
        if self.left and not times:
            stuck = [str(self.head(s)) for s in self.info if self.head(s) is not None]
            raise ScheduleError(f"the schedule deadlocks: {', '.join(stuck)} all wait")
        if times:
            self.t = times[0]
