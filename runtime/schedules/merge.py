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

from ..errors import ScheduleError
from .actions import Action
from .base import StageInfo, backward_first

# Idealised durations for ordering only: a backward costs about two forwards, recompute one
# more; split in two (zero-bubble), B and W one each.
_UNIT = {"F": 1, "B": 2, "W": 1, "S": 0}


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
    return _UNIT[a.kind] - (split and a.kind == "B") + a.recompute


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
    info = {s.id: s for s in stages}
    split = {s for s, acts in per_stage.items() if any(a.kind == "W" for a in acts)}
    producers, consumers = assumed_edges(stages)
    on_gpu: dict[int, list[int]] = {}
    for s in stages:
        on_gpu.setdefault(s.gpu, []).append(s.id)
    group_of = {s: tuple(g) for g in sync for s in g}
    end = {k: {s: {} for s in info} for k in "FBW"}  # kind -> stage -> mb -> end time
    pos = dict.fromkeys(info, 0)
    gpu_free = dict.fromkeys(on_gpu, 0)
    arrived: dict[tuple, set[int]] = {}  # (group, step) -> stages waiting at that step
    keyed: dict[int, list[tuple]] = {g: [] for g in on_gpu}
    left = sum(len(v) for v in per_stage.values())
    times, t = [], 0

    def head(s: int) -> Action | None:
        return per_stage[s][pos[s]] if pos[s] < len(per_stage[s]) else None

    def ready(s: int, a: Action) -> bool:
        if a.kind == "W":
            return end["B"][s].get(a.mb, t + 1) <= t
        if a.kind == "B" and end["F"][s].get(a.mb, t + 1) > t:
            return False
        done = end[a.kind]
        needed = producers[s] if a.kind == "F" else consumers[s]
        return all(done[d].get(a.mb, t + 1) <= t for d in needed)

    while left:
        for s in info:  # steps cost no time; a synchronised one waits for its whole group
            a = head(s)
            if a is not None and a.kind == "S" and gpu_free[info[s].gpu] <= t:
                group = group_of.get(s, (s,))
                waiting = arrived.setdefault((group, a.mb), set())
                waiting.add(s)
                if len(waiting) == len(group):
                    for member in group:
                        keyed[info[member].gpu].append((t, 0, group[0], a.mb, member, head(member)))
                        pos[member] += 1
                    left -= len(group)
        for g, ids in on_gpu.items():
            if gpu_free[g] > t:
                continue
            todo = [
                (priority(a, info[s]), s, a)
                for s in ids
                if (a := head(s)) is not None and a.kind != "S" and ready(s, a)
            ]
            if todo:
                _, s, a = min(todo)
                gpu_free[g] = end[a.kind][s][a.mb] = t + duration(a, s in split)
                keyed[g].append((t, 1, s, a.mb, s, a))
                pos[s] += 1
                left -= 1
                heapq.heappush(times, gpu_free[g])
        while times and times[0] <= t:
            heapq.heappop(times)
        if left and not times:
            stuck = [str(head(s)) for s in info if head(s) is not None]
            raise ScheduleError(f"the schedule deadlocks: {', '.join(stuck)} all wait")
        if times:
            t = times[0]
    lists = {
        g: [row[-1] for row in sorted(rows, key=lambda r: r[:5])]
        for g, rows in sorted(keyed.items())
    }
    return lists, max(gpu_free.values(), default=0)
