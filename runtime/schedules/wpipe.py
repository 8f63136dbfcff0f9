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
per cent of the busiest GPU's work for m >= N (tests/runtime/schedules/test_schedules.py).
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
    run = _Alternation(with_chunks(stages), m, steps)
    expected = left = (2 * m * steps + steps) * len(run.stages)
    while left:
        run.dispatch()
        left = expected - sum(map(len, run.lists.values()))
        if not run.advance(left):
            raise ScheduleError(f"wpipe: no order found for {run.gpus} GPUs and {m} micro-batches")
    return run.lists


class _Alternation:
    """One idealised run of `order`: time `t`, each GPU's list so far, G1's position in its
    stream, G0's next forward and backward and its steps taken."""

    def __init__(self, stages: list[StageInfo], m: int, steps: int):
        self.stages, self.m, self.total = stages, m, m * steps
        self.gpus = max(s.gpu for s in stages) + 1
        self.pol = {s.id: policy(s, m, self.gpus) for s in stages}
        self.g0 = g0 = {s.gpu: s for s in stages if s.chunk == 0}
        g1 = {s.gpu: s for s in stages if s.chunk == 1}
        self.stream = {g: flushed(st, self.pol[st.id], m, steps) for g, st in g1.items()}
        self.producers, self.consumers = assumed_edges(stages)
        self.end: dict[tuple[str, int, int], int] = {}  # (kind, stage, mb) -> idealised end
        self.pos = dict.fromkeys(g1, 0)  # G1: next action of its stream
        self.nxt_f, self.nxt_b = dict.fromkeys(g0, 0), dict.fromkeys(g0, 0)
        self.stepped = dict.fromkeys(g0, 0)
        self.lists: dict[int, list[Action]] = {g: [] for g in sorted(g0)}
        self.turn, self.free = dict.fromkeys(g0, 0), dict.fromkeys(g0, 0)
        self.times, self.t = [0], 0

    def done(self, kind: str, stages, mb: int) -> bool:
        return all(self.end.get((kind, s, mb), self.t + 1) <= self.t for s in stages)

    def g1_ready(self, g: int) -> Action | None:
        stream, pos = self.stream[g], self.pos
        while pos[g] < len(stream) and stream[pos[g]].kind == "S":
            self.lists[g].append(stream[pos[g]])  # a step takes no time: emit it at once
            pos[g] += 1
        if pos[g] == len(stream):
            return None
        a = stream[pos[g]]
        need = self.producers[a.stage] if a.kind == "F" else self.consumers[a.stage]
        return a if self.done(a.kind, need, a.mb) else None

    def g0_ready(self, g: int) -> Action | None:
        s = self.g0[g].id
        p, f, b = self.pol[s], self.nxt_f[g], self.nxt_b[g]
        if (
            f < self.total
            and f - b < p.in_flight
            and self.stepped[g] >= p.version(f, self.m)
            and self.done("F", self.producers[s], f)
        ):
            return Action("F", s, f)
        if b < f and self.done("F", (s,), b) and self.done("B", self.consumers[s], b):
            return Action("B", s, b, p.recompute)
        return None

    def dispatch(self) -> None:
        """Every idle GPU runs the group whose turn it is, or the other when that one waits."""
        for g in self.lists:
            if self.free[g] > self.t:
                continue
            ready = {0: self.g0_ready(g), 1: self.g1_ready(g)}
            group = self.turn[g] if ready[self.turn[g]] else 1 - self.turn[g]
            a = ready[group]
            if a is None:
                continue
            self.lists[g].append(a)
            self.free[g] = self.end[(a.kind, a.stage, a.mb)] = self.t + duration(a)
            heapq.heappush(self.times, self.free[g])
            self.turn[g] = 1 - group
            if group:
                self.pos[g] += 1
            elif a.kind == "F":
                self.nxt_f[g] += 1
            else:
                self.nxt_b[g] += 1
                if self.nxt_b[g] % self.m == 0:
                    self.lists[g].append(Action("S", a.stage, self.nxt_b[g] // self.m - 1))
                    self.stepped[g] += 1
        for g in self.lists:  # G1's last step, once its last backward was scheduled
            self.g1_ready(g)

    def advance(self, left: int) -> bool:
        """To the next idealised end; False when actions are left and nothing runs."""
        times = self.times
        while times and times[0] <= self.t:
            heapq.heappop(times)
        if left and not times:
            return False
        if times:
            self.t = times[0]
        return True


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
