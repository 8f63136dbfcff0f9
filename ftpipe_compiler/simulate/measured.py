"""A real run's timeline (the package's `--trace FILE`) in the simulator's terms, to set the
simulation beside what happened.

    run = measured(read_trace("trace.json"), gpus=plan.gpus)
    run.step_time_s, run.timeline, run.error(result)   # result: a SimResult of the same plan

The step time is measured as the simulator measures it: E_k is when the last rank finishes
step k (its last optimizer step), and the step time is the mean of E_k - E_{k-1} over the
last half of the steps. The timeline keeps the first steps of the first replica, GPU by GPU.
"""

from __future__ import annotations

from dataclasses import dataclass

from ftpipe_runtime.engine.trace import read_trace
from ftpipe_runtime.errors import PipelineConfigError

from ..errors import FtpipeError
from .result import Event, SimResult
from .simulator import TIMELINE_STEPS

__all__ = ["MeasuredRun", "load_measured", "measured"]


@dataclass(frozen=True)
class MeasuredRun:
    schedule: str
    micro_batches: int
    steps: int
    step_time_s: float
    step_ends_s: tuple[float, ...]
    timeline: tuple[Event, ...]
    waited_s: float  # per step, over every GPU of the first replica: waiting for messages

    def error(self, result: SimResult) -> float:
        """(simulated - measured) / measured step time."""
        return (result.step_time_s - self.step_time_s) / self.step_time_s

    def summary(self) -> dict:
        return {
            "schedule": self.schedule,
            "micro_batches": self.micro_batches,
            "steps": self.steps,
            "step_time_s": self.step_time_s,
            "step_ends_s": list(self.step_ends_s),
            "waited_s": self.waited_s,
        }


def load_measured(path, gpus: int) -> MeasuredRun:
    try:
        return measured(read_trace(path), gpus)
    except PipelineConfigError as e:
        raise FtpipeError(str(e)) from None


def measured(trace: dict, gpus: int) -> MeasuredRun:
    ranks = [r for r in trace["ranks"] if r.get("replica", 0) == 0]
    if sorted(r["gpu"] for r in ranks) != list(range(gpus)):
        raise FtpipeError(
            f"the trace is of {len(ranks)} GPUs, the plan has {gpus}: was it run from this plan?"
        )
    m, first = int(trace["micro_batches"]), int(trace.get("first", 0))
    ends: dict[int, float] = {}
    events, waited = [], 0.0
    for r in ranks:
        # Rows of format 2 on carry cpu, faults[, sys] after these six.
        for kind, stage, mb, start, end, wait, *_ in r["actions"]:
            if kind == "E":  # evaluation rounds are not the simulator's
                continue
            step = mb if kind == "S" else mb // m
            if kind == "S":
                ends[step] = max(ends.get(step, 0.0), end)
            if step - first < TIMELINE_STEPS:
                events.append(Event(r["gpu"], stage, kind, mb, start, end))
            waited += wait
    steps = sorted(ends)
    if len(steps) < 2:
        raise FtpipeError("the trace has fewer than 2 steps: run the package for more --steps")
    e = [ends[k] for k in steps]
    n = len(e) // 2
    step_time = (e[-1] - e[-1 - n]) / n
    return MeasuredRun(
        schedule=str(trace.get("schedule", "")),
        micro_batches=m,
        steps=len(steps),
        step_time_s=step_time,
        step_ends_s=tuple(e),
        timeline=tuple(sorted(events, key=lambda ev: (ev.gpu, ev.start))),
        waited_s=waited / len(steps),
    )
