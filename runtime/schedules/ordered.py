"""Schedules that order whole GPU lists by rule (interleaved 1F1B, ZB-V): one step's order,
repeated every step with a flush, and the memory statement counted from that order.

    given = per_step(order, policy)        # Schedule(given=...)
    peaks = _peaks(order, gpus, m)         # {position: (in flight, deferred)}

`order(gpus, m)` returns one step's actions per GPU as (kind, chain position, micro-batch)
triples, micro-batches 0..m-1, chain positions being the stage ids of the schedule's
placement. Every step repeats that order with micro-batches shifted by k * m; each GPU ends
the step with the optimizer steps of its stages (the flush). Recompute flags come from the
schedule's policy. The validator checks the result like any other list.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

from .actions import Action
from .base import StageInfo, StagePolicy

Order = Callable[[int, int], dict[int, list[tuple[str, int, int]]]]


def per_step(order: Order, policy_of) -> Callable:
    """A `given` function: (stages, m, steps) -> per-GPU lists, `order` repeated every step."""

    def given(stages: list[StageInfo], m: int, steps: int) -> dict[int, list[Action]]:
        gpus = max(s.gpu for s in stages) + 1
        pol = {s.id: policy_of(s, m, gpus) for s in stages}
        lists = {}
        for g, row in sorted(order(gpus, m).items()):
            mine = sorted(s.id for s in stages if s.gpu == g)
            out = []
            for k in range(steps):
                out += [Action(kind, s, k * m + mb, kind == "B" and pol[s].recompute)
                        for kind, s, mb in row]  # fmt: skip
                out += [Action("S", s, k) for s in mine]
            lists[g] = out
        return lists

    return given


@functools.lru_cache(maxsize=256)
def _peaks(order: Order, gpus: int, m: int) -> dict[int, tuple[int, int]]:
    """(most micro-batches between F and their last backward action, most between B and W)."""
    out: dict[int, tuple[int, int]] = {}
    for row in order(gpus, m).values():
        split = {s for kind, s, _ in row if kind == "W"}
        live: dict[int, int] = {}
        waiting: dict[int, int] = {}
        for kind, s, _ in row:
            if kind == "F":
                live[s] = live.get(s, 0) + 1
            elif kind == "B" and s in split:
                waiting[s] = waiting.get(s, 0) + 1
            else:  # a B that frees, or a W
                live[s] -= 1
                if kind == "W":
                    waiting[s] -= 1
            in_flight, wait = out.get(s, (0, 0))
            out[s] = (max(in_flight, live.get(s, 0)), max(wait, waiting.get(s, 0)))
    return out


def counted_policy(order: Order, st: StageInfo, m: int, gpus: int, split: bool) -> StagePolicy:
    """The policy a schedule given by `order` states: recompute everywhere but the loss stage
    (as 1F1B), micro-batches in flight as the order holds them (counted, not guessed)."""
    in_flight, wait = _peaks(order, gpus, m).get(st.id, (1, 0))
    return StagePolicy(
        recompute=not st.is_last, in_flight=in_flight, split=split, deferred=wait if split else 0
    )
