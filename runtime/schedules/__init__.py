"""Pipeline schedules as data: per-GPU action lists, and what each schedule keeps in memory.

    stages = [StageInfo(id=0, gpu=0, depth=1, is_last=False), StageInfo(1, 1, 0, True)]
    actions("1f1b", stages, micro_batches=4, steps=2)   # {0: [0F0, 0F1, 0R0, ...], 1: [...]}
    get_schedule("wpipe").policy(stage, 8, gpus=4)      # StagePolicy(recompute, in_flight, ...)
    resolve_schedule("my.csv")                          # a schedule written as a CSV file

The runtime executes these lists and the simulator times them, so the two agree on what
runs when. A GPU executes its list strictly in order; an action waits for what its kind
needs (`actions.KINDS`): F of a stage for micro-batch m needs F of its producer stages for
m, B needs B of its consumer stages for m. Micro-batch numbers are global across steps
(step k covers k*M .. k*M+M-1), so an asynchronous schedule is one continuous stream.

A new schedule is one file in this folder defining `SCHEDULE = Schedule(...)` (see
`gpipe.py`), its module in the import line and one line in `SCHEDULES` below.
"""

from __future__ import annotations

from ..errors import ScheduleError, pick
from . import ftpipe, gpipe, interleaved, one_f_one_b, pipedream_2bw, wpipe, zb1p, zb2p, zbv
from .actions import KINDS, Action, Kind
from .base import FREE, V_SHAPE, Placement, Schedule, StageInfo, StagePolicy, looped, with_chunks
from .from_csv import csv_schedule, listed_schedule, read_lists, write_lists
from .merge import interleave
from .periodic import Pattern
from .timeline import Timeline, drains_at_checkpoints
from .validate import StageGraph, validate
from .versions import ForwardVersions, Versions, WeightPlan, weight_plan

SCHEDULES: dict[str, Schedule] = {
    "gpipe": gpipe.SCHEDULE,
    "1f1b": one_f_one_b.SCHEDULE,
    "ftpipe": ftpipe.SCHEDULE,
    "2bw": pipedream_2bw.SCHEDULE,
    "wpipe": wpipe.SCHEDULE,
    "zb1p": zb1p.SCHEDULE,
    "zb2p": zb2p.SCHEDULE,
    "zbv": zbv.SCHEDULE,
    "interleaved": interleaved.SCHEDULE,
}

__all__ = [
    "FREE",
    "ForwardVersions",
    "KINDS",
    "SCHEDULES",
    "Action",
    "Kind",
    "Pattern",
    "Placement",
    "Schedule",
    "ScheduleError",
    "StageGraph",
    "StageInfo",
    "StagePolicy",
    "Timeline",
    "Versions",
    "V_SHAPE",
    "WeightPlan",
    "actions",
    "csv_schedule",
    "drains_at_checkpoints",
    "get_schedule",
    "interleave",
    "listed_schedule",
    "looped",
    "read_lists",
    "resolve_schedule",
    "validate",
    "weight_plan",
    "with_chunks",
    "write_lists",
]


def get_schedule(name: str) -> Schedule:
    return pick(SCHEDULES, name, "schedule", ScheduleError, " or give a .csv file")


def resolve_schedule(name: str, recompute: bool = True) -> Schedule:
    """A built-in schedule by name, or the schedule written in a .csv file; `recompute`
    False: its variant keeping every stage's activations (a plan's `recompute: false`)."""
    sched = csv_schedule(name) if name.lower().endswith(".csv") else get_schedule(name)
    return sched if recompute else sched.without_recompute()


def actions(
    schedule: str, stages: list[StageInfo], micro_batches: int, steps: int = 1
) -> dict[int, list[Action]]:
    """Ordered actions per GPU. Under a synchronous schedule all stages step together, so
    each GPU's S actions of step k come together after all its F and B of step k."""
    return resolve_schedule(schedule).actions(stages, micro_batches, steps)
