"""Schedules and plans side by side: one simulation per (plan, schedule), one table.

    rows = compare([("t5-3b mixed", plan, "ftpipe"), ("t5-3b mixed", plan, "gpipe")], steps=10)
    print(table(rows))          # samples/s, step time, bubble, max memory, fits
    [row.to_json() for row in rows]

A schedule a plan cannot run (WPipe needs its two-groups-per-GPU placement) is a row with
the reason instead of figures, not a failure of the whole comparison.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from ..errors import FtpipeError, UnknownNameError
from ..units import rate
from .simulator import simulate


@dataclass(frozen=True)
class Row:
    label: str  # which plan
    schedule: str
    stages: int = 0
    samples_per_s: float = 0.0
    step_time_s: float = 0.0
    bubble_fraction: float = 0.0
    max_memory_bytes: int = 0
    memory_bytes: int = 0  # per-GPU capacity
    error: str = ""  # why this plan cannot run this schedule

    @property
    def fits(self) -> bool:
        return not self.error and self.max_memory_bytes <= self.memory_bytes

    def to_json(self) -> dict:
        return {**asdict(self), "fits": self.fits}


def compare(runs, steps: int = 10, micro_batches: int | None = None) -> list[Row]:
    """`runs`: (label, plan, schedule name or .csv path) triples, simulated in order."""
    rows = []
    for label, plan, schedule in runs:
        try:
            sim = simulate(plan, schedule, micro_batches, steps)
        except UnknownNameError:
            raise
        except FtpipeError as e:
            rows.append(Row(label, schedule, len(plan.stages), error=str(e)))
            continue
        rows.append(
            Row(
                label,
                schedule,
                len(plan.stages),
                sim.samples_per_s,
                sim.step_time_s,
                sim.bubble_fraction,
                sim.max_memory_bytes,
                plan.memory_bytes,
            )
        )
    return rows


def table(rows: list[Row]) -> str:
    width = max([len(r.label) for r in rows] + [4])
    swidth = max([len(r.schedule) for r in rows] + [8])
    head = (
        f"{'plan':<{width}}  {'schedule':<{swidth}} {'stages':>6} {'samples/s':>10} "
        f"{'step s':>9} {'bubble':>7} {'max GiB':>8} {'of GiB':>7}  fits"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        start = f"{r.label:<{width}}  {r.schedule:<{swidth}} {r.stages:>6}"
        if r.error:
            lines.append(f"{start}  cannot run: {r.error}")
            continue
        lines.append(
            f"{start} {rate(r.samples_per_s):>10} {r.step_time_s:>9.4f} "
            f"{100 * r.bubble_fraction:>6.1f}% {r.max_memory_bytes / 2**30:>8.2f} "
            f"{r.memory_bytes / 2**30:>7.2f}  {'yes' if r.fits else 'no'}"
        )
    return "\n".join(lines)
