"""Which version of its weights every action of a GPU runs on, and which to keep aside, followed
action by action (the executor runs it; `validate` replays it to count the versions alive).

    v = Versions(policies, micro_batches, steps=10)
    v.use(action)         # (stage, version) of a set-aside copy it runs on, or None: the weights
    v.step(action)        # at S: ((stage, version) to set aside before stepping, or None, [drops])
    plan = weight_plan(actions_of_one_gpu, policies, micro_batches)   # the whole list's account

A stage whose policy pins versions (`weight_delay` d not None) runs micro-batch mb of step
k on its weights after max(k - d, 0) of its own steps, forward and backward alike. With
d >= 1 a version is still needed after the step that replaces it (the backwards of step
w + d come after the stage's step w + d - 1, which `validate` checks), so every version some
step uses is run on a copy set aside at its first use or at the step replacing it,
whichever comes first (kept graphs never see the step's in-place update), and dropped at
the stage's step w + d, after the last micro-batch that uses it, before that step sets its
own version aside. A stage that recomputes (no split backward) keeps no graph of its weights
past an action: its actions on the version the weights hold now run on them, and the step
replacing it sets it aside, so the stage holds two copies (the paper's two versions), not
a third from a step's first forward to the step before it. Nothing here looks ahead:
a run of any length, or one resumed at step k with the versions k - d .. k - 1 restored
from its checkpoint (`first=k`), is followed the same way. `steps` None: the run may go on
past its end (resumed from its final checkpoint), so its last steps keep aside the versions
the next ones would use, as every step before them does; the executor runs that way.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..errors import ScheduleError
from .base import StagePolicy

Key = tuple[int, int]  # (stage, version: the stage's steps behind those weights)


class Versions:
    def __init__(
        self,
        policies: dict[int, StagePolicy],
        micro_batches: int,
        steps: int | None,
        first: int = 0,
    ):
        self.policies, self.m, self.end = policies, micro_batches, steps
        self.taken = dict.fromkeys(policies, first)  # steps each stage has taken
        self.aside: set[Key] = {(s, w) for s in policies for w in self.needed_at(s, first)}

    def delay(self, s: int) -> int:
        d = self.policies[s].weight_delay
        return d or 0  # None (the weights as they are) and 0 keep nothing aside

    def needed_at(self, s: int, step: int) -> list[int]:
        """Older versions of stage s that steps from `step` on still use (those a checkpoint
        at `step` keeps, and a run resumed there restores)."""
        d = self.delay(s)
        return [w for w in range(max(step - d, 0), step) if self._needed_after(s, w)]

    def _needed_after(self, s: int, w: int) -> bool:
        """Does a step after w (w + d, or 1..d for version 0) of this run use version w?"""
        d = self.delay(s)
        return d > 0 and (self.end is None or (w + d if w else 1) < self.end)

    def use(self, a) -> Key | None:
        """The set-aside version `a` runs on (made now if this is its first use), or None."""
        if not a.spec.trains:  # evaluation runs on the weights current at its turn
            return None
        s = a.stage
        v = self.policies[s].version(a.mb, self.m)
        if v is None:
            return None
        if v > self.taken[s]:
            raise ScheduleError(
                f"{a} needs the weights of stage {s} after {v} of its steps, but it has taken "
                f"{self.taken[s]} there; move it after {s}S{v - 1}"
            )
        if not self._needed_after(s, v):
            return None  # used only before the step that replaces it: the weights themselves
        if v == self.taken[s] and (s, v) not in self.aside and self._graph_free(s):
            return None  # the weights are that version now; the step replacing it keeps it
        self.aside.add((s, v))
        return (s, v)

    def _graph_free(self, s: int) -> bool:
        """Do stage s's actions leave no graph of its weights behind them? A recomputing
        stage's forward keeps its inputs, its backward recomputes and is done; a split
        backward keeps its graph for the W after it."""
        policy = self.policies[s]
        return policy.recompute and not policy.split

    def step(self, a) -> tuple[Key | None, list[Key]]:
        """At stage a.stage's step: the version to set aside first (None: none, or already
        aside), and the versions no micro-batch needs any more afterwards."""
        s = a.stage
        w = self.taken[s]
        keep = None
        if self._needed_after(s, w) and (s, w) not in self.aside:
            keep = (s, w)
            self.aside.add(keep)
        self.taken[s] = w + 1
        drop = sorted(k for k in self.aside if k[0] == s and k[1] + self.delay(s) <= w)
        self.aside.difference_update(drop)
        return keep, drop

    def alive(self, s: int) -> int:
        """Versions of stage s held now: the weights and the older ones set aside."""
        return len({self.taken[s]} | {w for t, w in self.aside if t == s})

    def held(self, s: int) -> int:
        """Copies of stage s's weights held now (the executor's stash): the live weights and
        each version set aside, the live one among them where a kept graph reads it."""
        return 1 + sum(t == s for t, _ in self.aside)


@dataclass
class WeightPlan:
    version: dict[tuple[int, int], int] = field(default_factory=dict)  # (stage, mb) -> version
    stashed: set[Key] = field(default_factory=set)  # versions run on a set-aside copy
    most: dict[int, int] = field(default_factory=dict)  # stage -> most versions alive at once
    # stage -> most copies of its weights held at once: the live ones and those set aside (a
    # copy of the live version among them, where a kept graph reads it across a step)
    copies: dict[int, int] = field(default_factory=dict)


def weight_plan(
    acts, policies: dict[int, StagePolicy], micro_batches: int, steps: int | None = None
) -> WeightPlan:
    """The account of one GPU's whole list; raises ScheduleError for a version used too early."""
    if steps is None:
        steps = 1 + max((a.mb for a in acts if a.kind == "S"), default=0)
    follow = Versions(policies, micro_batches, steps)
    stages = {a.stage for a in acts}
    plan = WeightPlan(most=dict.fromkeys(stages, 1), copies=dict.fromkeys(stages, 1))
    for a in acts:
        if not a.spec.trains:  # evaluation runs on the weights current at its turn
            continue
        if a.kind == "S":
            keep, _ = follow.step(a)
            if keep:
                plan.stashed.add(keep)
        else:
            key = follow.use(a)
            v = policies[a.stage].version(a.mb, micro_batches)
            if v is not None:
                plan.version[(a.stage, a.mb)] = v
            if key:
                plan.stashed.add(key)
        plan.most[a.stage] = max(plan.most[a.stage], follow.alive(a.stage))
        plan.copies[a.stage] = max(plan.copies[a.stage], follow.held(a.stage))
    return plan


class ForwardVersions:
    """Which version of a stage's weights each of its training forwards reads, from its GPU's
    actions in order (a list, or a stream made as it is asked): the version its policy pins
    (`weight_delay`), or else the steps the stage took before the forward (`first` of them
    before a resumed run's first action). A weight the stage sends to other stages goes once
    per version: the runtime's `Dataflow` and the simulator both ask here which forwards one
    message serves, so the two send the same.

        fv = ForwardVersions(actions_of_gpu, stage=0, policy=pol, micro_batches=4)
        fv.version(mb)      # the version micro-batch mb's forward reads
        fv.forwards(v)      # how many of the stage's forwards read version v

    A stage's forwards run in micro-batch order, and the versions they read never go back,
    so a version is a run of consecutive micro-batches; only the latest `KEEP` are kept.
    """

    KEEP = 4096  # versions remembered: far more than any schedule keeps in flight

    def __init__(self, acts, stage: int, policy: StagePolicy, micro_batches: int, first: int = 0):
        self._acts, self.stage, self.policy, self.m = iter(acts), stage, policy, micro_batches
        self._taken = first
        self._runs: list[list[int]] = []  # [version, first mb, forwards], oldest first
        self._done = False

    def _advance(self) -> bool:
        """Read on to the stage's next training forward; False at the end of the actions."""
        for a in self._acts:
            if a.stage != self.stage or not a.spec.trains:
                continue
            if a.kind == "S":
                self._taken += 1
            elif a.kind == "F":
                v = self.policy.version(a.mb, self.m)
                v = self._taken if v is None else v
                if self._runs and self._runs[-1][0] == v:
                    self._runs[-1][2] += 1
                else:
                    self._runs.append([v, a.mb, 1])
                    del self._runs[: -self.KEEP]
                return True
        self._done = True
        return False

    def version(self, mb: int) -> int:
        while not self._runs or self._runs[-1][1] + self._runs[-1][2] <= mb:
            if not self._advance():
                raise ScheduleError(f"stage {self.stage} runs no forward of micro-batch {mb}")
        for v, start, _ in reversed(self._runs):
            if start <= mb:
                return v
        raise ScheduleError(f"stage {self.stage}: micro-batch {mb} is too old to look up")

    def forwards(self, v: int) -> int:
        while not self._done and (not self._runs or self._runs[-1][0] <= v):
            self._advance()
        for w, _, n in reversed(self._runs):
            if w == v:
                return n
        raise ScheduleError(f"stage {self.stage} runs no forward on its weights version {v}")
