"""ZB-H2 (Qi et al., ICLR'24 §3.1, "ZB2P"): zero bubble, for about twice 1F1B's activations.

Up to 2P - 1 micro-batches in flight on every stage (F until W), so the first stage keeps
forwarding until its first B arrives and the last stage defers its W's into the tail. The
order of one step is found, once per (P, m), by running a chain of P stages with unit
durations: an idle stage runs a B whose gradient has arrived, else a forward whose input has
arrived while it holds fewer than 2P - 1 micro-batches, else its oldest W. Every stage is
then busy from its first forward to its last W: the step is a parallelogram, the last stage
starting P - 1 forwards after the first and ending as much later (tests check it).

A flush (every stage stepping together) would cost exactly those P - 1 forwards, so ZB-H2
has none: each stage takes its optimizer step after its own last W and starts the next
step's forwards on the new weights, the data flow alone ordering the stages (§4's bypassed
optimizer synchronisation, without its roll-back). The update is exactly mini-batch SGD as
with 1F1B; what it gives up is one gradient norm over all stages: `--clip` clips each stage
by its own norm (zb1p or zbv clip by the global one).

A stage at depth d takes the order of chain position max(P - 1 - d, 0); stages sharing a
GPU are merged as every free-placement schedule's are. Memory: 2P - 1 micro-batches (fewer
for small m) held until their W, counted from the order; the loss stage keeps its
activations, the others recompute, as in 1F1B.
"""

from __future__ import annotations

import functools

from ..errors import ScheduleError
from .actions import Action
from .base import Schedule, StageInfo, StagePolicy, with_chunks
from .merge import backward_first, interleave


@functools.lru_cache(maxsize=64)
def chain_order(gpus: int, m: int) -> tuple[tuple[tuple[str, int], ...], ...]:
    """One step's (kind, micro-batch) order of every chain position, by unit-time greedy."""
    limit = min(m, 2 * gpus - 1)
    order: list[list[tuple[str, int]]] = [[] for _ in range(gpus)]
    f_end: dict[tuple[int, int], int] = {}
    b_end: dict[tuple[int, int], int] = {}
    nf, nb, nw = [0] * gpus, [0] * gpus, [0] * gpus
    t = 0
    while any(len(row) < 3 * m for row in order):
        if t > 6 * m + 4 * gpus:  # the greedy always finishes by 3m + P - 1; a bug otherwise
            raise ScheduleError(f"zb2p: no order found for {gpus} GPUs and {m} micro-batches")
        for r in range(gpus):
            b, f = nb[r], nf[r]
            if b < f and f_end[r, b] <= t and (r == gpus - 1 or b_end.get((r + 1, b), t + 1) <= t):
                order[r].append(("B", b))
                b_end[r, b], nb[r] = t + 1, b + 1
            elif f < m and f - nw[r] < limit and (r == 0 or f_end.get((r - 1, f), t + 1) <= t):
                order[r].append(("F", f))
                f_end[r, f], nf[r] = t + 1, f + 1
            elif nw[r] < nb[r]:
                order[r].append(("W", nw[r]))
                nw[r] += 1
        t += 1
    return tuple(tuple(row) for row in order)


def _position(st: StageInfo, gpus: int) -> int:
    return min(max(gpus - 1 - st.depth, 0), gpus - 1)


def policy(st: StageInfo, m: int, gpus: int) -> StagePolicy:
    in_flight = wait = most_in_flight = most_wait = 0
    for kind, _ in chain_order(gpus, m)[_position(st, gpus)]:
        in_flight += (kind == "F") - (kind == "W")
        wait += (kind == "B") - (kind == "W")
        most_in_flight, most_wait = max(most_in_flight, in_flight), max(most_wait, wait)
    return StagePolicy(
        recompute=not st.is_last, in_flight=most_in_flight, split=True, deferred=most_wait
    )


def order(stages: list[StageInfo], m: int, steps: int) -> dict[int, list[Action]]:
    stages = with_chunks(stages)
    gpus = max(s.gpu for s in stages) + 1
    per_stage = {}
    for st in stages:
        rec = policy(st, m, gpus).recompute
        row = chain_order(gpus, m)[_position(st, gpus)]
        per_stage[st.id] = [
            a
            for k in range(steps)
            for a in (
                *(Action(kind, st.id, k * m + mb, kind == "B" and rec) for kind, mb in row),
                Action("S", st.id, k),
            )
        ]
    return interleave(stages, per_stage, (), backward_first)


SCHEDULE = Schedule(
    "zb2p", None, policy, synchronous=False, given=order, doc="ZB-H2: zero bubble, no flush"
)
