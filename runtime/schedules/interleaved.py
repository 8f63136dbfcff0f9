"""Interleaved 1F1B (Narayanan et al., SC'21 §2.2, Megatron-LM): v model chunks per GPU,
placed in a loop (chain position p on GPU p mod P), each step flushed.

Micro-batches go through in rounds of r (r = m / max(1, m // P), so m must split into equal
rounds): GPU g runs the forwards of a round for chunk 0, then chunk 1, ..., and the
backwards of a round from the last chunk back. It first runs (v - 1) * r + 2 (P - 1 - g)
forwards (the warm-up that lets the first backward arrive), then alternates one forward and
one backward, then drains. Each chunk is 1/v of a GPU's work, so the fill and drain shrink
v-fold: the bubble is (P - 1) / (v m) of the compute instead of 1F1B's (P - 1) / m, at the
price of v times the point-to-point messages.

Memory: recompute everywhere but the loss stage, as 1F1B; a chunk holds the micro-batches
its GPU's order holds between its forward and its backward (counted from the order: the
first GPU's chunks hold the most). `interleaved` has v = 2; `schedule(v)` builds others.
"""

from __future__ import annotations

import functools

from .base import Schedule, StageInfo, looped
from .ordered import counted_policy, per_step

CHUNKS = 2


def rounds(m: int, gpus: int) -> int:
    return max(1, m // gpus)


def refuse(m: int, gpus: int) -> str:
    k = rounds(m, gpus)
    if m % k:
        fits = [x for x in range(max(m - 4, 1), m + 5) if x % rounds(x, gpus) == 0]
        return (
            f"interleaved runs micro-batches in equal rounds of about {gpus}; {m} does not "
            f"split into {k} (try --micro-batches {min(fits, key=lambda x: abs(x - m))})"
        )
    return ""


def order(v: int, gpus: int, m: int) -> dict[int, list[tuple[str, int, int]]]:
    k = rounds(m, gpus)
    r = m // k
    out = {}
    for g in range(gpus):
        mbs = [range(i * r, (i + 1) * r) for i in range(k)]
        fwd = [(c * gpus + g, mb) for rnd in mbs for c in range(v) for mb in rnd]
        bwd = [(c * gpus + g, mb) for rnd in mbs for c in reversed(range(v)) for mb in rnd]
        warmup = min(len(fwd), (v - 1) * r + 2 * (gpus - 1 - g))
        row = [("F", *f) for f in fwd[:warmup]]
        for i, b in enumerate(bwd):
            if warmup + i < len(fwd):
                row.append(("F", *fwd[warmup + i]))
            row.append(("B", *b))
        out[g] = row
    return out


@functools.cache
def schedule(v: int) -> Schedule:
    """Interleaved 1F1B with v chunks per GPU."""
    chunks = functools.partial(order, v)

    def policy(st: StageInfo, m: int, gpus: int):
        return counted_policy(chunks, st, m, gpus, split=False)

    return Schedule(
        "interleaved" if v == CHUNKS else f"interleaved{v}",
        None,
        policy,
        synchronous=True,
        placement=looped(v),
        given=per_step(chunks, policy),
        refuse=refuse,
        doc=f"interleaved 1F1B, {v} chunks per GPU",
    )


SCHEDULE = schedule(CHUNKS)
