"""Which version of its weights every action of a GPU list runs on, and which to keep aside.

    plan = weight_plan(actions_of_one_gpu, policies, micro_batches)
    plan.version[(stage, mb)]   # steps of the stage behind the weights it uses (pinned stages)
    plan.stashed                # {(stage, version)} still needed after the stage steps past it
    plan.last_use[(stage, v)]   # index of the last action using that version
    plan.most[stage]            # most versions of the stage alive at once

A stage whose policy pins versions (`weight_delay` not None) runs micro-batch mb of step k
on the weights after max(k - delay, 0) of its own steps, forward and backward alike. When
such a version is needed after the step that replaces it, the executor keeps a copy aside
(from its first use, so no kept graph sees the step's in-place update) and drops it after
its last use. The validator checks that this never exceeds the policy's `weight_versions`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..errors import ScheduleError
from .base import StagePolicy


@dataclass
class WeightPlan:
    version: dict[tuple[int, int], int] = field(default_factory=dict)
    stashed: set[tuple[int, int]] = field(default_factory=set)
    last_use: dict[tuple[int, int], int] = field(default_factory=dict)
    most: dict[int, int] = field(default_factory=dict)


def weight_plan(acts, policies: dict[int, StagePolicy], micro_batches: int) -> WeightPlan:
    plan = WeightPlan()
    steps: dict[int, int] = {}  # stage -> steps taken before the current action
    step_at: dict[tuple[int, int], int] = {}  # (stage, step number) -> index of its S
    for i, a in enumerate(acts):
        s = a.stage
        if a.kind == "S":
            step_at[(s, steps.get(s, 0))] = i
            steps[s] = steps.get(s, 0) + 1
            continue
        if not a.spec.trains:  # evaluation runs on the weights current at its turn
            continue
        v = policies[s].version(a.mb, micro_batches)
        if v is None:
            continue
        if v > steps.get(s, 0):
            raise ScheduleError(
                f"{a} needs the weights of stage {s} after {v} of its steps, but it has taken "
                f"{steps.get(s, 0)} there; move it after {s}S{v - 1}"
            )
        plan.version[(s, a.mb)] = v
        plan.last_use[(s, v)] = i
    for (s, v), last in plan.last_use.items():
        if step_at.get((s, v), last) < last:
            plan.stashed.add((s, v))
    # Versions alive at each action: the newest, and every older one still to be used.
    alive: dict[int, set[int]] = {s: {0} for s in policies}
    steps.clear()
    for i, a in enumerate(acts):
        s = a.stage
        if a.kind == "S":
            steps[s] = steps.get(s, 0) + 1
            alive[s] = {v for v in alive[s] if plan.last_use.get((s, v), -1) > i} | {steps[s]}
        plan.most[s] = max(plan.most.get(s, 1), len(alive.get(s, ())))
    return plan
