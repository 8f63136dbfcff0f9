"""Runs a command as a pipeline of phases: each phase only does its work on a shared job;
the driver times each, shows one progress bar (on a terminal only), and prints the result
once, as JSON or as text.

    drive(Pipeline(phases=(Phase("trace", "trace_s", trace), ...), to_json=..., lines=...), job,
          as_json=False)
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tqdm import tqdm

from .echo import echo_json, echo_lines

__all__ = ["Phase", "Pipeline", "drive"]


@dataclass(frozen=True)
class Phase:
    name: str  # what the progress bar shows while it runs
    timing: str  # its key in the timings reported
    run: Callable[[Any], None]  # does the work, recording what it made on the job
    weight: int = 1  # progress units, for phases that take longer


@dataclass(frozen=True)
class Pipeline:
    phases: tuple[Phase, ...]
    to_json: Callable[[Any, dict], dict]  # (job, timings) -> what --json prints
    lines: Callable[[Any, dict], list[str]]  # (job, timings) -> what people read


def drive(pipeline: Pipeline, job, *, as_json: bool, desc: str = "compile") -> dict:
    """Run the phases in order; returns the timings (seconds per phase, and `total_s`)."""
    timings: dict[str, float] = {}
    start = time.perf_counter()
    bar = tqdm(
        total=sum(p.weight for p in pipeline.phases),
        desc=desc,
        file=sys.stderr,
        disable=None,  # None: no bar unless stderr is a terminal
        leave=False,
        bar_format="{desc}: {n}/{total} {postfix}",
    )
    try:
        for phase in pipeline.phases:
            bar.set_postfix_str(phase.name)
            t0 = time.perf_counter()
            phase.run(job)
            timings[phase.timing] = time.perf_counter() - t0
            bar.update(phase.weight)
    finally:
        bar.close()
    timings["total_s"] = time.perf_counter() - start
    if as_json:
        echo_json(pipeline.to_json(job, timings))
    else:
        echo_lines(pipeline.lines(job, timings))
    return timings
