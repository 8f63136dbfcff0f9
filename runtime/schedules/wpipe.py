"""WPipe's double-grouped weight updates (2GW; Yang et al., ICLR'22 §3.2).

Every GPU's share of the model is split in two: a chain of 2N stages placed in a loop, so
GPU i holds position i (group G0) and position N + i (group G1), as in the paper's Figure 4.
G1 runs 1F1B and steps after each of its periods (m micro-batches) with one weight version:
plain mini-batch SGD. G0 runs the next period's forwards ahead of the current period's
backwards: in period k it forwards micro-batches of step k + 1 (min(m, N - i) of them
before its first backward of step k, the rest one after each backward), then steps. Its
forward and backward of step k therefore use its weights after k - 1 steps: two versions,
one step stale, W(t+1) = W(t) - lr * grad f(W(t-1)) (eq. 1, i = 0). The groups step
alternately, each stage on its own. Needs m >= N (§3.3).

The two streams of a GPU are merged by idealised list scheduling; of a few priorities
(backward first, then G0 / G1 / the oldest micro-batch first) the one with the shortest
idealised run is kept (`merge.interleave`).
"""

from __future__ import annotations

from .actions import Action
from .base import Schedule, StageInfo, StagePolicy, flushed, looped

GROUPS = 2


def stream(st: StageInfo, policy: StagePolicy, m: int, steps: int) -> list[Action]:
    if st.chunk:
        return flushed(st, policy, m, steps)
    ahead = policy.in_flight - m  # forwards of the next step before the first backward
    out = [Action("F", st.id, j) for j in range(m)]
    for k in range(steps):
        nxt = [Action("F", st.id, (k + 1) * m + j) for j in range(m)] if k + 1 < steps else []
        out += nxt[:ahead]
        for j in range(m):
            out.append(Action("B", st.id, k * m + j, policy.recompute))
            out += nxt[ahead + j : ahead + j + 1]
        out.append(Action("S", st.id, k))
    return out


def policy(st: StageInfo, m: int, gpus: int) -> StagePolicy:
    if st.chunk == 0:
        return StagePolicy(True, m + min(m, gpus - st.gpu), weight_versions=2, weight_delay=1)
    return StagePolicy(not st.is_last, min(m, st.depth + 1))


PRIORITIES = (
    lambda a, st: (a.kind != "B", st.chunk, a.mb),  # backward first, then G0
    lambda a, st: (a.kind != "B", -st.chunk, a.mb),  # backward first, then G1
    lambda a, st: (a.kind != "B", a.mb, st.id),  # backward first, then the oldest
)

SCHEDULE = Schedule(
    "wpipe",
    stream,
    policy,
    synchronous=False,
    placement=looped(GROUPS),
    priority=PRIORITIES,
    min_micro_batches=lambda gpus: gpus,
    doc="WPipe (2GW)",
)
