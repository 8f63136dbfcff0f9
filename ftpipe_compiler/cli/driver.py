"""Runs a command as a pipeline of phases: each phase only does its work on a shared job;
the driver times each, shows its progress, and prints the result once, as JSON or as text.

    drive(Pipeline(phases=(Phase("trace", "trace_s", trace), ...), to_json=..., lines=...), job,
          as_json=False)

Progress goes to stderr: on a terminal, one bar for the whole command (a phase may move it
within its share by calling the `progress(done, total, what)` it is given); elsewhere (a log
file, a pipe), a line per phase with its time, so that a long compile shows where it is.
With --json, only the JSON.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import click
from ftpipe_runtime.job.signals import noting
from tqdm import tqdm

from .echo import echo_json, echo_lines

__all__ = ["Phase", "Pipeline", "Progress", "drive"]

Progress = Callable[[int, int, str], None]  # (done, total, what is running) within a phase


@dataclass(frozen=True)
class Phase:
    name: str  # what the progress shows while it runs
    timing: str  # its key in the timings reported
    run: Callable[[Any, Progress], None]  # does the work, recording what it made on the job
    weight: int = 1  # its share of the bar, for phases that take longer


@dataclass(frozen=True)
class Pipeline:
    phases: tuple[Phase, ...]
    to_json: Callable[[Any, dict], dict]  # (job, timings) -> what --json prints
    lines: Callable[[Any, dict], list[str]]  # (job, timings) -> what people read


STEPS = 100  # bar units per unit of phase weight: room for a phase's own progress


class _Shown:
    """The bar on a terminal, the phase lines elsewhere, nothing under --json."""

    def __init__(self, phases: tuple[Phase, ...], desc: str, *, quiet: bool):
        self.desc = desc
        self.lines = not quiet and not sys.stderr.isatty()
        self.bar = tqdm(
            total=sum(p.weight for p in phases) * STEPS,
            desc=desc,
            file=sys.stderr,
            disable=True if quiet or self.lines else None,
            leave=False,
            bar_format="{desc}: {percentage:3.0f}% |{bar:20}| {elapsed}{postfix}",
        )
        self.start = 0  # bar units before the running phase
        self.phase: Phase | None = None

    def begin(self, phase: Phase) -> None:
        self.phase = phase
        self.bar.set_postfix_str(phase.name)

    def within(self, done: int, total: int, what: str = "") -> None:
        units = self.phase.weight * STEPS * min(done, total) // max(total, 1)
        self.bar.n = self.start + units
        self.bar.set_postfix_str(f"{self.phase.name}: {what}" if what else self.phase.name)

    def end(self, seconds: float) -> None:
        self.start += self.phase.weight * STEPS
        self.bar.n = self.start
        self.bar.refresh()
        if self.lines:
            click.echo(f"{self.desc}: {self.phase.name} ({seconds:.1f} s)", err=True)

    def close(self) -> None:
        self.bar.close()


def drive(pipeline: Pipeline, job, *, as_json: bool, desc: str = "compile") -> dict:
    """Run the phases in order; returns the timings (seconds per phase, and `total_s`)."""
    timings: dict[str, float] = {}
    start = time.perf_counter()
    shown = _Shown(pipeline.phases, desc, quiet=as_json)
    # A Ctrl-C or SIGTERM that a library swallowed (its exception dropped) still stops the
    # command, at the end of its phase: before the outputs are written.
    with noting() as came:
        try:
            for phase in pipeline.phases:
                shown.begin(phase)
                t0 = time.perf_counter()
                phase.run(job, shown.within)
                if came:
                    raise type(came[0])()
                timings[phase.timing] = time.perf_counter() - t0
                shown.end(timings[phase.timing])
        finally:
            shown.close()
    timings["total_s"] = time.perf_counter() - start
    if as_json:
        echo_json(pipeline.to_json(job, timings))
    else:
        echo_lines(pipeline.lines(job, timings))
    return timings
