"""The one check of per-GPU action lists, for built-in schedules and CSV files alike.

    validate(lists, StageGraph.of(stages, consumers), schedule, micro_batches, steps)

Refuses, naming the offending action: an action on a GPU that does not host its stage, a
repeated or skipped micro-batch, a backward before its forward, a weight-gradient pass (W)
where the schedule does not split the stage's backward or missing where it does, a W before
its B, a step that does not close exactly its own backwards (its W's when split), more
micro-batches or weight versions held than the schedule's memory statement says, a later step started before a synchronous step, and lists that
cannot finish: executed in order, each action waiting for what its kind needs (`KINDS`)
and a synchronous step for every GPU, some GPU would wait forever.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import ScheduleError
from .actions import KINDS, Action
from .base import Schedule, StageInfo, StagePolicy, with_chunks
from .versions import weight_plan


@dataclass(frozen=True)
class StageGraph:
    stages: tuple[StageInfo, ...]
    consumers: dict[int, tuple[int, ...]]  # stage -> stages it sends to (real edges)

    @classmethod
    def of(cls, stages, consumers: dict[int, tuple[int, ...]]) -> StageGraph:
        stages = tuple(with_chunks(stages))
        return cls(stages, {s.id: tuple(sorted(consumers.get(s.id, ()))) for s in stages})

    def related(self, relation: str, stage: int) -> tuple[int, ...]:
        if relation == "self":
            return (stage,)
        if relation == "consumers":
            return self.consumers[stage]
        return tuple(p for p, cs in self.consumers.items() if stage in cs)


def validate(
    lists: dict[int, list[Action]],
    graph: StageGraph,
    schedule: Schedule,
    micro_batches: int,
    steps: int,
) -> None:
    m, stages = micro_batches, {s.id: s for s in graph.stages}
    policies = schedule.policies(list(graph.stages), m)
    _check_members(lists, stages, policies, m, steps)
    for g, acts in lists.items():
        _check_stage_order(g, acts, policies, m)
        plan = weight_plan(acts, policies, m, steps)
        for s, most in plan.most.items():
            if most > policies[s].weight_versions:
                raise ScheduleError(
                    f"stage {s} would keep {most} versions of its weights on GPU {g}; "
                    f"{schedule.name} keeps {policies[s].weight_versions}"
                )
    groups = schedule.step_groups(list(graph.stages))
    if groups:
        _check_flush(lists, m)
    _check_progress(lists, graph, groups, m)


def _check_members(lists, stages: dict[int, StageInfo], policies, m: int, steps: int) -> None:
    """Every action on its stage's GPU, each once; nothing missing, nothing out of range; a
    W exactly for the stages whose backward the schedule splits."""
    seen: set[tuple[str, int, int]] = set()
    for g, acts in lists.items():
        for a in acts:
            if a.stage not in stages:
                raise ScheduleError(f"{a} on GPU {g}: the plan has no stage {a.stage}")
            if stages[a.stage].gpu != g:
                raise ScheduleError(
                    f"{a} is on GPU {g}, but stage {a.stage} is on GPU {stages[a.stage].gpu}"
                )
            if not a.spec.trains:  # evaluation: numbered apart, checked for progress only
                continue
            if a.spec.optional and not policies[a.stage].split:
                raise ScheduleError(
                    f"{a} on GPU {g}: the schedule does not split stage {a.stage}'s backward "
                    f"into B and W, so it has no {a.spec.meaning}"
                )
            top = m * steps if a.spec.per_micro_batch else steps
            if not 0 <= a.mb < top:
                what = "micro-batches" if a.spec.per_micro_batch else "steps"
                raise ScheduleError(f"{a} on GPU {g} is outside {what} 0..{top - 1}")
            key = (a.kind, a.stage, a.mb)
            if key in seen:
                raise ScheduleError(f"{a} appears twice")
            seen.add(key)
    for s in sorted(stages):
        for kind in (k for k in KINDS.values() if k.trains):
            if kind.optional and not policies[s].split:
                continue
            top = m * steps if kind.per_micro_batch else steps
            for mb in range(top):
                if (kind.letter, s, mb) not in seen:
                    what = "micro-batch" if kind.per_micro_batch else "step"
                    raise ScheduleError(
                        f"{s}{kind.letter}{mb} is missing: stage {s} never runs its "
                        f"{kind.meaning} of {what} {mb} (GPU {stages[s].gpu} skips it)"
                    )


def _check_stage_order(g: int, acts: list[Action], policies: dict[int, StagePolicy], m: int):
    """Per stage: forward before backward before W, a step after exactly its own backwards
    (W's when split), the recompute flag and the micro-batches in flight (until W when
    split, and between B and W) as the schedule's policy states."""
    order = _StageOrder(g, acts, policies, m)
    check = {"F": order.forward, "B": order.backward, "W": order.weight, "S": order.step}
    for i, a in enumerate(acts):
        if a.kind in check:
            check[a.kind](i, a)


class _StageOrder:
    """What one GPU's list has done so far, per stage (`_check_stage_order`)."""

    def __init__(self, g: int, acts: list[Action], policies: dict[int, StagePolicy], m: int):
        self.g, self.acts, self.policies, self.m = g, acts, policies, m
        self.forward_at: dict[tuple[int, int], int] = {}
        self.backward_done: set[tuple[int, int]] = set()
        self.steps: dict[int, int] = {}
        self.backwards: dict[int, list[int]] = {}  # stage -> micro-batches since its last step
        self.in_flight: dict[int, int] = {}  # stage -> micro-batches forwarded, not yet done
        self.waiting: dict[int, int] = {}  # stage -> micro-batches whose B ran and W has not

    def forward(self, i: int, a: Action) -> None:
        s, allowed = a.stage, self.policies[a.stage].in_flight
        self.forward_at[(s, a.mb)] = i
        self.in_flight[s] = self.in_flight.get(s, 0) + 1
        if self.in_flight[s] > allowed:
            raise ScheduleError(
                f"{a} on GPU {self.g}: stage {s} would hold {self.in_flight[s]} micro-batches, "
                f"the schedule's memory model allows {allowed}"
            )

    def backward(self, i: int, a: Action) -> None:
        s, pol, g = a.stage, self.policies[a.stage], self.g
        if (s, a.mb) not in self.forward_at:
            raise ScheduleError(f"{a} comes before {s}F{a.mb} on GPU {g}")
        if a.recompute != pol.recompute:
            how = "recomputes" if pol.recompute else "keeps its activations"
            raise ScheduleError(f"{a} on GPU {g}: stage {s} {how} under this schedule")
        if a.mb // self.m != self.steps.get(s, 0):
            raise ScheduleError(
                f"{a} on GPU {g} belongs to step {a.mb // self.m}, but stage {s} is "
                f"accumulating step {self.steps.get(s, 0)}"
            )
        if pol.weight_delay is None and not a.recompute:
            between = self.acts[self.forward_at[(s, a.mb)] : i]
            if any(b.kind == "S" and b.stage == s for b in between):
                raise ScheduleError(
                    f"stage {s} steps between {s}F{a.mb} and {a} without recomputing on "
                    f"GPU {g}; the activations it kept would be stale"
                )
        if not pol.split:
            self._done(a)
            return
        self.backward_done.add((s, a.mb))
        self.waiting[s] = self.waiting.get(s, 0) + 1
        if pol.recompute and self.waiting[s] > pol.deferred:
            raise ScheduleError(
                f"{a} on GPU {g}: stage {s} would keep the activations of "
                f"{self.waiting[s]} micro-batches until their W, the schedule's memory "
                f"model allows {pol.deferred}"
            )

    def weight(self, i: int, a: Action) -> None:
        s = a.stage
        if (s, a.mb) not in self.backward_done:
            raise ScheduleError(f"{a} comes before {s}B{a.mb} on GPU {self.g}")
        self.backward_done.discard((s, a.mb))
        self.waiting[s] -= 1
        self._done(a)

    def _done(self, a: Action) -> None:
        """The micro-batch's last pass on the stage: no longer in flight, counts for the step."""
        self.in_flight[a.stage] -= 1
        self.backwards.setdefault(a.stage, []).append(a.mb)

    def step(self, i: int, a: Action) -> None:
        s, m = a.stage, self.m
        want = list(range(a.mb * m, a.mb * m + m))
        if a.mb != self.steps.get(s, 0) or sorted(self.backwards.get(s, [])) != want:
            raise ScheduleError(
                f"{a} on GPU {self.g} does not follow exactly the {m} backwards of step "
                f"{a.mb} of stage {s}"
            )
        self.steps[s] = a.mb + 1
        self.backwards[s] = []


def _check_flush(lists, m: int) -> None:
    """Synchronous: nothing of step k + 1 on a GPU before that GPU's steps of step k."""
    for g, acts in lists.items():
        newest = -1
        for a in acts:
            if a.kind == "S":
                if newest > a.mb:
                    raise ScheduleError(
                        f"GPU {g} starts step {newest} before {a}: under a synchronous "
                        "schedule a step is finished before the next starts"
                    )
            elif a.spec.trains:
                newest = max(newest, a.mb // m)


def _check_progress(lists, graph: StageGraph, groups, m: int) -> None:
    """Execute the lists in order with no durations; raise naming where every GPU waits."""
    grouped = {s for grp in groups for s in grp}
    last_step: dict[int, dict[int, int]] = {}  # GPU -> step -> index of its last grouped S
    for g, acts in lists.items():
        for i, a in enumerate(acts):
            if a.kind == "S" and a.stage in grouped:
                last_step.setdefault(g, {})[a.mb] = i
    meeting = {k for steps in last_step.values() for k in steps}
    hosts = {k: {g for g, steps in last_step.items() if k in steps} for k in meeting}
    done: set[tuple[str, int, int]] = set()
    pos = dict.fromkeys(lists, 0)
    arrived: dict[int, set[int]] = {}

    def missing(g: int, i: int, a: Action):
        """What `a` still waits for: None, ("step", k) or (kind, stage, micro-batch)."""
        if a.kind == "S" and last_step.get(g, {}).get(a.mb) == i:
            arrived.setdefault(a.mb, set()).add(g)
            return None if arrived[a.mb] >= hosts[a.mb] else ("step", a.mb)
        for kind, relation in a.spec.needs:
            for t in graph.related(relation, a.stage):
                if (kind, t, a.mb) not in done:
                    return (kind, t, a.mb)
        return None

    moved = True
    while moved:
        moved = False
        for g, acts in lists.items():
            while pos[g] < len(acts) and missing(g, pos[g], acts[pos[g]]) is None:
                a = acts[pos[g]]
                done.add((a.kind, a.stage, a.mb))
                pos[g] += 1
                moved = True
    stuck = [(g, acts[pos[g]]) for g, acts in lists.items() if pos[g] < len(acts)]
    if not stuck:
        return
    parts = []
    for g, a in stuck:
        need = missing(g, pos[g], a)
        if need[0] == "step":
            parts.append(f"GPU {g} at {a} waits for the other GPUs' step {need[1]}")
            continue
        kind, t, mb = need
        if any((b.kind, b.stage, b.mb) == need for b in lists[g][pos[g] :]):
            raise ScheduleError(f"{a} comes before {t}{kind}{mb} on GPU {g}, and needs it")
        parts.append(f"GPU {g} at {a} waits for {t}{kind}{mb}")
    raise ScheduleError("these action lists deadlock: " + "; ".join(parts))
