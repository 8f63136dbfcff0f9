"""WPipe's double-grouped weight updates (2GW; Yang et al., ICLR'22 §3.2).

Every GPU's share of the model is split in two: a chain of 2N stages placed in a loop, so
GPU i holds position i (group G0) and position N + i (group G1), as in the paper's Figure 4.
G1 runs 1F1B and steps after each of its periods (m micro-batches) with one weight version:
plain mini-batch SGD. G0 runs the next period's forwards ahead of the current period's
backwards, so its forward and backward of step k use its weights after k - 1 steps: two
versions, one step stale, W(t+1) = W(t) - lr * grad f(W(t-1)) (eq. 1, i = 0). Each stage
steps on its own. Needs m >= N (§3.3).

The order (`order`): each GPU runs its two groups alternately whenever both have an action
ready ("executed alternately", §3.2), G1 in its 1F1B order, G0 a forward when one may start
(its producer has run it, the version it needs exists, fewer than m + min(m, N - i)
micro-batches are held), else its oldest backward. With idealised durations this fills
G1's per-step flush with G0's work: on uniform stages the idealised step is within a few
per cent of the busiest GPU's work for m >= N (tests/runtime/test_schedules.py).
"""

from __future__ import annotations

import heapq

from ..errors import ScheduleError
from .actions import Action
from .base import Schedule, StageInfo, StagePolicy, flushed, looped, with_chunks
from .merge import assumed_edges, duration

GROUPS = 2


def policy(st: StageInfo, m: int, gpus: int) -> StagePolicy:
    if st.chunk == 0:
        return StagePolicy(True, m + min(m, gpus - st.gpu), weight_versions=2, weight_delay=1)
    return StagePolicy(not st.is_last, min(m, st.depth + 1))


def order(stages: list[StageInfo], m: int, steps: int) -> dict[int, list[Action]]:
    """Per-GPU lists: G1's 1F1B stream and G0's forwards and backwards, alternated."""
    stages = with_chunks(stages)
    gpus = max(s.gpu for s in stages) + 1
    pol = {s.id: policy(s, m, gpus) for s in stages}
    g0 = {s.gpu: s for s in stages if s.chunk == 0}
    g1 = {s.gpu: s for s in stages if s.chunk == 1}
    stream = {g: flushed(st, pol[st.id], m, steps) for g, st in g1.items()}
    producers, consumers = assumed_edges(stages)
    end: dict[tuple[str, int, int], int] = {}  # (kind, stage, mb) -> idealised end
    pos = dict.fromkeys(g1, 0)  # G1: next action of its stream
    nxt_f, nxt_b, stepped = dict.fromkeys(g0, 0), dict.fromkeys(g0, 0), dict.fromkeys(g0, 0)
    lists: dict[int, list[Action]] = {g: [] for g in sorted(g0)}
    turn, free = dict.fromkeys(g0, 0), dict.fromkeys(g0, 0)
    total, times, t = m * steps, [0], 0

    def done(kind: str, stages_, mb: int) -> bool:
        return all(end.get((kind, s, mb), t + 1) <= t for s in stages_)

    def g1_ready(g: int) -> Action | None:
        while pos[g] < len(stream[g]) and stream[g][pos[g]].kind == "S":
            lists[g].append(stream[g][pos[g]])  # a step takes no time: emit it at once
            pos[g] += 1
        if pos[g] == len(stream[g]):
            return None
        a = stream[g][pos[g]]
        need = producers[a.stage] if a.kind == "F" else consumers[a.stage]
        return a if done(a.kind, need, a.mb) else None

    def g0_ready(g: int) -> Action | None:
        s, p, f = g0[g].id, pol[g0[g].id], nxt_f[g]
        if (
            f < total
            and f - nxt_b[g] < p.in_flight
            and stepped[g] >= p.version(f, m)
            and done("F", producers[s], f)
        ):
            return Action("F", s, f)
        b = nxt_b[g]
        if b < f and done("F", (s,), b) and done("B", consumers[s], b):
            return Action("B", s, b, p.recompute)
        return None

    expected = (2 * total + steps) * len(stages)
    left = expected
    while left:
        for g in lists:
            if free[g] > t:
                continue
            ready = {0: g0_ready(g), 1: g1_ready(g)}
            group = turn[g] if ready[turn[g]] else 1 - turn[g]
            a = ready[group]
            if a is None:
                continue
            lists[g].append(a)
            free[g] = end[(a.kind, a.stage, a.mb)] = t + duration(a)
            heapq.heappush(times, free[g])
            turn[g] = 1 - group
            if group:
                pos[g] += 1
            elif a.kind == "F":
                nxt_f[g] += 1
            else:
                nxt_b[g] += 1
                if nxt_b[g] % m == 0:
                    lists[g].append(Action("S", a.stage, nxt_b[g] // m - 1))
                    stepped[g] += 1
        for g in lists:  # G1's last step, once its last backward was scheduled
            g1_ready(g)
        left = expected - sum(map(len, lists.values()))
        while times and times[0] <= t:
            heapq.heappop(times)
        if left and not times:
            raise ScheduleError(f"wpipe: no order found for {gpus} GPUs and {m} micro-batches")
        if times:
            t = times[0]
    return lists


SCHEDULE = Schedule(
    "wpipe",
    None,
    policy,
    synchronous=False,
    placement=looped(GROUPS),
    min_micro_batches=lambda gpus: gpus,
    given=order,
    doc="WPipe (2GW)",
)
