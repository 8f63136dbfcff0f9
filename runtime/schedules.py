"""Pipeline schedules: pure functions from stages and micro-batches to per-GPU action lists.

    stages = [StageInfo(id=0, gpu=0, depth=1, is_last=False), StageInfo(1, 1, 0, True)]
    actions("1f1b", stages, micro_batches=4, steps=2)   # {0: [0F0, 0F1, 0R0, ...], 1: [...]}

The runtime executes these lists and the simulator times them, so the two agree on what
runs when. A GPU executes its list strictly in order; an action waits for its inputs:
F of a stage for micro-batch m needs F of its producer stages for m, B needs B of its
consumer stages for m. Micro-batch numbers are global across steps (step k covers
k*M .. k*M+M-1), so the asynchronous schedule is one continuous stream.
"""

from __future__ import annotations

import heapq
import re
from collections.abc import Callable
from dataclasses import dataclass, field

KINDS = ("F", "B", "S")
_ACTION = re.compile(r"(\d+)([FBRS])(\d+)")


@dataclass(frozen=True)
class Action:
    kind: str  # "F" forward | "B" backward | "S" optimizer step
    stage: int
    mb: int  # global micro-batch; for "S", the step number (0, 1, ...)
    recompute: bool = False  # B only: recompute the forward from the saved stage inputs first

    def __post_init__(self):
        if self.kind not in KINDS or (self.recompute and self.kind != "B"):
            raise ValueError(f"bad action {self.kind!r} (recompute={self.recompute})")

    def __str__(self) -> str:
        return f"{self.stage}{'R' if self.recompute else self.kind}{self.mb}"

    @classmethod
    def parse(cls, text: str) -> Action:
        """`Action.parse("3R2")` -> Action("B", 3, 2, recompute=True)."""
        m = _ACTION.fullmatch(text.strip())
        if not m:
            raise ValueError(f"not an action: {text!r}; write e.g. 3F2, 3B2, 3R2 or 3S1")
        stage, letter, mb = m.groups()
        return cls("B" if letter == "R" else letter, int(stage), int(mb), letter == "R")


@dataclass(frozen=True)
class StageInfo:
    id: int  # topologically ordered: a stage only receives from lower ids
    gpu: int
    depth: int  # stages on the longest path to the loss stage
    is_last: bool  # computes the loss


def _gpipe(st: StageInfo, m: int, steps: int, rec: bool) -> list[Action]:
    out = []
    for k in range(steps):
        mbs = range(k * m, (k + 1) * m)
        out += [Action("F", st.id, i) for i in mbs]
        out += [Action("B", st.id, i, rec) for i in reversed(mbs)]
        out.append(Action("S", st.id, k))
    return out


def _one_f_one_b(st: StageInfo, first: int, count: int, warmup: int, rec: bool, m: int):
    """`warmup` forwards, then one backward / one forward, then the remaining backwards;
    an optimizer step after every m-th backward."""
    out = [Action("F", st.id, first + j) for j in range(min(warmup, count))]
    for i in range(count):
        out.append(Action("B", st.id, first + i, rec))
        if (first + i + 1) % m == 0:
            out.append(Action("S", st.id, (first + i) // m))
        if i + warmup < count:
            out.append(Action("F", st.id, first + i + warmup))
    return out


def _1f1b(st: StageInfo, m: int, steps: int, rec: bool) -> list[Action]:
    warmup = min(m, st.depth + 1)
    return [a for k in range(steps) for a in _one_f_one_b(st, k * m, m, warmup, rec, m)]


def _ftpipe(st: StageInfo, m: int, steps: int, rec: bool) -> list[Action]:
    # FTPipe async (§4.2, Fig. 5): depth + 1 forwards fill the pipe, then B/F alternate
    # forever; gradients accumulate over m backwards, no flush, no weight stashing.
    return _one_f_one_b(st, 0, m * steps, st.depth + 1, rec, m)


@dataclass(frozen=True)
class Schedule:
    name: str
    synchronous: bool
    recompute_last: bool  # does the stage computing the loss recompute too?
    stage_order: Callable[[StageInfo, int, int, bool], list[Action]] = field(
        default=_ftpipe, repr=False, compare=False
    )
    held: Callable[[int, int], int] = field(
        default=lambda depth, m: depth + 1, repr=False, compare=False
    )

    def recompute(self, is_last: bool) -> bool:
        return self.recompute_last or not is_last

    def in_flight(self, depth: int, micro_batches: int) -> int:
        """Micro-batches whose inputs a stage at `depth` (stages after it) holds at once."""
        return self.held(depth, micro_batches)

    def stage_actions(self, st: StageInfo, micro_batches: int, steps: int = 1) -> list[Action]:
        return self.stage_order(st, micro_batches, steps, self.recompute(st.is_last))

    def actions(
        self, stages: list[StageInfo], micro_batches: int, steps: int = 1
    ) -> dict[int, list[Action]]:
        """The ordered action list of every GPU; see `actions`."""
        if micro_batches < 1 or steps < 1:
            raise ValueError(
                f"need micro_batches >= 1 and steps >= 1, not {micro_batches}, {steps}"
            )
        per_stage = {s.id: self.stage_actions(s, micro_batches, steps) for s in stages}
        return interleave(stages, per_stage, self.step_groups(stages))

    def step_groups(self, stages: list[StageInfo]) -> tuple[tuple[int, ...], ...]:
        """Stage sets whose optimizer steps happen together: under a synchronous schedule
        every stage (the flush: no GPU starts step k+1 before all of step k is done, and one
        gradient norm clips them all); under the asynchronous one none, every stage steps
        at its own S (a weight read by several stages travels with the micro-batches)."""
        if self.synchronous:
            return (tuple(sorted(s.id for s in stages)),)
        return ()


SCHEDULES = {
    "gpipe": Schedule("gpipe", True, True, _gpipe, lambda depth, m: m),
    "1f1b": Schedule("1f1b", True, False, _1f1b, lambda depth, m: min(m, depth + 1)),
    "ftpipe": Schedule("ftpipe", False, False, _ftpipe, lambda depth, m: depth + 1),
}


def get_schedule(name: str) -> Schedule:
    try:
        return SCHEDULES[name]
    except KeyError:
        raise ValueError(f"unknown schedule {name!r}; choose from {', '.join(SCHEDULES)}") from None


def actions(
    schedule: str, stages: list[StageInfo], micro_batches: int, steps: int = 1
) -> dict[int, list[Action]]:
    """Ordered actions per GPU. Under a synchronous schedule all stages step together, so
    each GPU's S actions of step k come together after all its F and B of step k."""
    return get_schedule(schedule).actions(stages, micro_batches, steps)


# Idealised durations for ordering only: a backward costs about two forwards, recompute one more.
_UNIT = {"F": 1, "B": 2, "S": 0}


def _priority(a: Action, st: StageInfo) -> tuple:
    """Which ready action an idle GPU takes first: backwards (they free memory and unblock
    upstream stages), then the oldest micro-batch."""
    return (0 if a.kind == "B" else 1, a.mb, st.id)


def _reduced(deps: dict[int, set[int]]) -> dict[int, list[int]]:
    """Drop implied dependencies (the relation is transitive): waiting for the nearest suffices."""
    return {s: sorted(d - {x for y in d for x in deps[y]}) for s, d in deps.items()}


def interleave(
    stages: list[StageInfo], per_stage: dict[int, list[Action]], sync=()
) -> dict[int, list[Action]]:
    """Merge the stages' action lists into one list per GPU that cannot deadlock.

    Execute the stages on their GPUs with unit durations (an idle GPU takes the most urgent
    ready head action of its stages) and sort each GPU's actions by their idealised start.
    Stage edges are not known here, so a stage is assumed to depend on every lower-id stage
    of greater depth (a superset of the real edges: those always go to a lower depth). Every
    dependency then starts strictly earlier and a synchronised step has one start and one
    key on all its GPUs, so the per-GPU orders follow one global order; executing them in
    order with any durations always finds the globally first pending action runnable.
    """
    info = {s.id: s for s in stages}
    producers = _reduced(
        {s.id: {p.id for p in stages if p.id < s.id and p.depth > s.depth} for s in stages}
    )
    consumers = _reduced(
        {s.id: {c.id for c in stages if c.id > s.id and c.depth < s.depth} for s in stages}
    )
    on_gpu: dict[int, list[int]] = {}
    for s in stages:
        on_gpu.setdefault(s.gpu, []).append(s.id)
    group_of = {s: tuple(g) for g in sync for s in g}
    end = {"F": {s: {} for s in info}, "B": {s: {} for s in info}}  # stage -> mb -> end time
    pos = dict.fromkeys(info, 0)
    gpu_free = dict.fromkeys(on_gpu, 0)
    arrived: dict[tuple, set[int]] = {}  # (group, step) -> stages waiting at that step
    keyed: dict[int, list[tuple]] = {g: [] for g in on_gpu}
    left = sum(len(v) for v in per_stage.values())
    times, t = [], 0

    def head(s: int) -> Action | None:
        return per_stage[s][pos[s]] if pos[s] < len(per_stage[s]) else None

    def ready(s: int, a: Action) -> bool:
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
                (_priority(a, info[s]), s, a)
                for s in ids
                if (a := head(s)) is not None and a.kind != "S" and ready(s, a)
            ]
            if todo:
                _, s, a = min(todo)
                gpu_free[g] = end[a.kind][s][a.mb] = t + _UNIT[a.kind] + a.recompute
                keyed[g].append((t, 1, s, a.mb, s, a))
                pos[s] += 1
                left -= 1
                heapq.heappush(times, gpu_free[g])
        while times and times[0] <= t:
            heapq.heappop(times)
        if left and not times:
            stuck = [str(head(s)) for s in info if head(s) is not None]
            raise RuntimeError(f"the schedule deadlocks: {', '.join(stuck)} all wait")
        if times:
            t = times[0]
    return {
        g: [row[-1] for row in sorted(rows, key=lambda r: r[:5])]
        for g, rows in sorted(keyed.items())
    }
