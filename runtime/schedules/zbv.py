"""ZB-V (Qi et al., arXiv:2401.10241 §6): two chunks per GPU placed in a V, backwards split
into B and W, so the pipeline fills and drains on half-size chunks and W fills the rest.

GPU g holds chain positions g (chunk 0, on the way down) and 2P - 1 - g (chunk 1, on the way
back up; the loss stage is chunk 1 of GPU 0). One step's order on GPU g, with n = max(m,
2P - 1) micro-batches (those past m are left out afterwards):

1. 2(P - g) - 1 forwards of chunk 0;
2. g times: a forward of chunk 1, a forward of chunk 0;
3. P - g times: forward, B and W of chunk 1;
4. while forwards remain: [forward of chunk 0,] B and W of chunk 0, forward, B, W of chunk 1;
5. g times: B of chunk 0, B of chunk 1 (their W's wait);
6. P - g times: B of chunk 0 and its oldest W due;
7. the W's still due, chunk 1's first.

With equal F, B and W times every GPU is busy from its first forward to the flush: the only
bubble is the fill that the per-step flush (one gradient norm for clipping) imposes, P - 1
chunk forwards on the last GPU, and its mirror at the drain.

Memory (the paper's "same as 1F1B"): chunk 0 of GPU g holds up to 2(P - g) - 1 + g micro-
batches of half a GPU's layers, counted from the order; a micro-batch's graph lives until
its W. Recompute everywhere but the loss stage, as 1F1B.
"""

from __future__ import annotations

from .base import V_SHAPE, Schedule, StageInfo
from .ordered import counted_policy, per_step


def order(gpus: int, m: int) -> dict[int, list[tuple[str, int, int]]]:
    n = max(m, 2 * gpus - 1)
    return {g: [a for a in _gpu_order(g, gpus, n) if a[2] < m] for g in range(gpus)}


def _gpu_order(g: int, gpus: int, n: int) -> list[tuple[str, int, int]]:
    down, up = g, 2 * gpus - 1 - g
    nxt = {(k, s): 0 for k in "FBW" for s in (down, up)}
    row: list[tuple[str, int, int]] = []

    def run(*acts: tuple[str, int]) -> None:
        for kind, s in acts:
            row.append((kind, s, nxt[kind, s]))
            nxt[kind, s] += 1

    run(*[("F", down)] * (2 * (gpus - g) - 1))
    run(*[("F", up), ("F", down)] * g)
    run(*[("F", up), ("B", up), ("W", up)] * (gpus - g))
    while nxt["F", up] < nxt["F", down] or nxt["F", down] < n:
        if nxt["F", down] < n:
            run(("F", down))
        run(("B", down), ("W", down), ("F", up), ("B", up), ("W", up))
    run(*[("B", down), ("B", up)] * g)
    run(*[("B", down), ("W", down)] * (gpus - g))
    run(*[("W", up)] * (nxt["B", up] - nxt["W", up]))
    run(*[("W", down)] * (nxt["B", down] - nxt["W", down]))
    return row


def policy(st: StageInfo, m: int, gpus: int):
    return counted_policy(order, st, m, gpus, split=True)


SCHEDULE = Schedule(
    "zbv",
    None,
    policy,
    synchronous=True,
    placement=V_SHAPE,
    given=per_step(order, policy),
    doc="ZB-V: two chunks per GPU in a V, W deferred",
)
