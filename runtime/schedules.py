"""Pipeline schedules: pure functions from stages and micro-batches to per-GPU actions.

INTERFACE STUB — the action generators are being written; the memory-relevant
properties (which stages recompute, how many micro-batches a stage holds) are final.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Action:
    kind: str  # "F" | "B" | "STEP"
    stage: int
    mb: int = -1
    recompute: bool = False


@dataclass(frozen=True)
class Schedule:
    name: str
    synchronous: bool
    recompute_last: bool  # does the stage computing the loss recompute too?

    def recompute(self, is_last: bool) -> bool:
        return self.recompute_last or not is_last

    def in_flight(self, depth: int, micro_batches: int) -> int:
        """Micro-batches whose inputs a stage at `depth` (stages after it) holds at once."""
        if self.name == "gpipe":
            return micro_batches
        if self.name == "1f1b":
            return min(micro_batches, depth + 1)
        return depth + 1


SCHEDULES = {
    "gpipe": Schedule("gpipe", synchronous=True, recompute_last=True),
    "1f1b": Schedule("1f1b", synchronous=True, recompute_last=False),
    "ftpipe": Schedule("ftpipe", synchronous=False, recompute_last=False),
}


def get_schedule(name: str) -> Schedule:
    try:
        return SCHEDULES[name]
    except KeyError:
        raise ValueError(f"unknown schedule {name!r}; choose from {', '.join(SCHEDULES)}") from None
