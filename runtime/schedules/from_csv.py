"""A schedule written by hand: per-GPU action lists in a CSV file, one row per GPU.

    0F0,0F1,0R0,0F2,0R1,0R2,0S0
    1F0,1B0,1F1,1B1,1F2,1B2,1S0

The file holds one optimizer step (micro-batches 0..M-1, steps numbered 0); it is repeated
for every step, micro-batches and step numbers shifted. Cells may be empty; lines starting
with # are comments. What the memory model needs is read from the lists: a stage recomputes
if its backwards are written R, splits its backward if it has W's (3B2 input gradients, 3W2
weight gradients, later), and holds as many micro-batches as its forwards run ahead of its
last backward action.
The update is plain mini-batch SGD: one weight version, every stage steps together after
the step's backwards (a flush), like gpipe and 1f1b. `validate` checks the lists against
the plan before anything runs.
"""

from __future__ import annotations

from pathlib import Path

from ..errors import ScheduleError
from .actions import Action
from .base import Schedule, StageInfo, StagePolicy


def read_lists(path) -> dict[int, list[Action]]:
    """GPU -> its actions, from a CSV file (row g is GPU g)."""
    try:
        text = Path(path).read_text()
    except OSError as e:
        raise ScheduleError(f"cannot read the schedule file {path}: {e.strerror}") from None
    rows = [r for r in text.splitlines() if r.strip() and not r.lstrip().startswith("#")]
    lists = {}
    for g, row in enumerate(rows):
        try:
            lists[g] = [Action.parse(c) for c in row.split(",") if c.strip()]
        except ValueError as e:
            raise ScheduleError(f"{path}, row {g + 1} (GPU {g}): {e}") from None
        extra = next((a for a in lists[g] if not a.spec.trains), None)
        if extra is not None:
            raise ScheduleError(
                f"{path}, row {g + 1} (GPU {g}): {extra} is an {extra.spec.meaning}; a schedule "
                "lists training actions only (--eval-data adds the evaluation)"
            )
    if not any(lists.values()):
        raise ScheduleError(f"{path} holds no actions; write one row of actions per GPU")
    return lists


def write_lists(lists: dict[int, list[Action]], path) -> None:
    Path(path).write_text("".join(",".join(map(str, lists[g])) + "\n" for g in sorted(lists)))


def csv_schedule(path) -> Schedule:
    return listed_schedule(read_lists(path), str(path))


def listed_schedule(lists: dict[int, list[Action]], name: str = "listed") -> Schedule:
    """A schedule from one step's per-GPU lists (what a CSV file holds)."""
    acts = [a for row in lists.values() for a in row]
    m = 1 + max((a.mb for a in acts if a.spec.per_micro_batch), default=0)
    split = {a.stage for a in acts if a.kind == "W"}
    recompute: dict[int, set[bool]] = {}
    in_flight: dict[int, int] = {}
    most: dict[int, int] = {}  # stage -> most micro-batches in flight at once
    waiting: dict[int, int] = {}
    deferred: dict[int, int] = {}
    for a in acts:
        s = a.stage
        if a.kind == "B":
            recompute.setdefault(s, set()).add(a.recompute)
        if a.kind == "B" and s in split:  # its W frees the micro-batch
            waiting[s] = waiting.get(s, 0) + 1
            deferred[s] = max(deferred.get(s, 0), waiting[s])
            continue
        if a.kind == "W":
            waiting[s] = waiting.get(s, 0) - 1
        in_flight[s] = in_flight.get(s, 0) + a.spec.holds
        most[s] = max(most.get(s, 0), in_flight[s])
    mixed = [s for s, flags in recompute.items() if len(flags) > 1]
    if mixed:
        raise ScheduleError(
            f"{name}: stage {mixed[0]} recomputes in some backwards and not in others; "
            "write all its backwards as R or all as B"
        )

    def policy(st: StageInfo, micro_batches: int, gpus: int) -> StagePolicy:
        return StagePolicy(
            recompute=True in recompute.get(st.id, ()),
            in_flight=most.get(st.id, 0),
            split=st.id in split,
            deferred=deferred.get(st.id, 0),
        )

    def given(stages, micro_batches: int, steps: int) -> dict[int, list[Action]]:
        return {
            g: [_shifted(a, k, m) for k in range(steps) for a in row] for g, row in lists.items()
        }

    return Schedule(name, None, policy, synchronous=True, given=given, micro_batches=m, doc="CSV")


def _shifted(a: Action, step: int, m: int) -> Action:
    mb = a.mb + (step * m if a.spec.per_micro_batch else step)
    return Action(a.kind, a.stage, mb, a.recompute)
