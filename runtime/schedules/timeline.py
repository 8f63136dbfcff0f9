"""The run's actions on every GPU, made one step window at a time.

    tl = Timeline(schedule, stages, micro_batches, steps=100_000, first=0, drain_every=0)
    tl.check(graph)              # refuses lists that cannot run (the lengths that vouch for all)
    for a in tl.actions(gpu):    # global micro-batch and step numbers, made as they are asked for
    tl.lists()                   # whole lists (tests, a reference, short runs)

A run is one or more segments, each the schedule's own lists for its length shifted to its
first step (`periodic.Pattern` makes them window by window, so neither memory nor the time
to start grows with --steps). A run resumed at step k starts a segment there: the pipeline
fills again. That is exact when every micro-batch's weights are fixed by its step (flushed
schedules, and PipeDream-2BW and WPipe, whose older weight version the checkpoint keeps):
the same work on the same weights, in another order. Under FTPipe's asynchronous rule an
action reads the weights as they are when it runs (`weight_delay` None), so the order
matters: such a schedule drains the pipeline at every checkpoint step (`drain_every`),
uninterrupted or resumed alike, so that nothing is in flight when a checkpoint is taken.
"""

from __future__ import annotations

from collections.abc import Iterator

from .actions import Action
from .base import Schedule, StageInfo
from .periodic import Pattern, shifted
from .validate import StageGraph, validate

__all__ = ["Timeline", "drains_at_checkpoints"]


def drains_at_checkpoints(schedule: Schedule, stages: list[StageInfo], m: int) -> bool:
    """Whether a checkpoint of this schedule needs the pipeline drained (see the module)."""
    if schedule.synchronous:  # every step is a flush already
        return False
    return any(p.weight_delay is None for p in schedule.policies(stages, m).values())


class Timeline:
    def __init__(
        self,
        schedule: Schedule,
        stages: list[StageInfo],
        micro_batches: int,
        steps: int,
        first: int = 0,
        drain_every: int = 0,
        pattern: Pattern | None = None,
    ):
        if not 0 <= first < steps:
            raise ValueError(f"need 0 <= first < steps, not {first}, {steps}")
        self.schedule, self.stages, self.m = schedule, list(stages), micro_batches
        self.steps, self.first = steps, first
        self.drains = bool(drain_every) and drains_at_checkpoints(schedule, stages, micro_batches)
        cuts = range(drain_every, steps, drain_every) if self.drains else ()
        bounds = sorted({first, steps, *(k for k in cuts if k > first)})
        self.segments = list(zip(bounds, [b - a for a, b in zip(bounds, bounds[1:])]))
        self._drain_every = drain_every
        self._pattern = pattern

    @property
    def pattern(self) -> Pattern:
        if self._pattern is None:
            self._pattern = Pattern.find(self.schedule, self.stages, self.m)
        return self._pattern

    def resumed(self, first: int) -> Timeline:
        """The same run from step `first` on (a resumed run), sharing the measured pattern."""
        return Timeline(
            self.schedule, self.stages, self.m, self.steps, first, self._drain_every, self._pattern
        )

    def check(self, graph: StageGraph, rounds=None) -> None:
        """Validate the lists of every segment length: whole when short, else the lengths
        that vouch for every length (`periodic`); raises ScheduleError naming the action.
        `rounds(n)`: (gpu, actions) -> actions with evaluation rounds in an n-step run (at
        every step, the most there can be: fewer rounds only remove waits), or None."""
        lengths = sorted({n for _, n in self.segments})
        pat = Pattern(self.schedule, self.stages, self.m, periodic=False)
        short = min(lengths[0], 2)  # a malformed schedule fails here, cheaply
        validate(pat.lists(short), graph, self.schedule, self.m, short)
        pat = self.pattern
        todo = [n for n in lengths if n < pat.n0]
        if lengths[-1] >= pat.n0:
            todo += pat.instances()
        for n in todo:
            lists = pat.lists(n)
            add = rounds(n) if rounds is not None else None
            if add is not None:
                lists = {g: list(add(g, acts)) for g, acts in lists.items()}
            validate(lists, graph, self.schedule, self.m, n)

    def actions(self, gpu: int) -> Iterator[Action]:
        """This GPU's actions for the whole run, in order."""
        pat = self.pattern
        at = pat.gpus.index(gpu)
        for start, n in self.segments:
            for k in range(pat.windows(n)):
                for a in pat.window(k, n)[at]:
                    yield shifted(a, start, self.m)

    def lists(self) -> dict[int, list[Action]]:
        return {g: list(self.actions(g)) for g in self.pattern.gpus}
