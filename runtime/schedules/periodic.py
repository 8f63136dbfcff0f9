"""A schedule's lists for any number of steps, from a few short ones: head, period, tail.

    pat = Pattern.find(schedule, stages, micro_batches)
    pat.chunk(gpu, k, steps)      # GPU's actions of step window k in a run of `steps` steps
    pat.instances(span_gpus)      # the lengths `validate` must check in full (see below)

A GPU's list, cut after its last optimizer step of each step, is a sequence of step windows
("chunks"): chunk k ends with the GPU's last S of step k. A schedule is a pure function of
(stages, micro-batches, steps) with a fill at the start, a drain at the end and the same work
in between, so for every N >= n0 = h + p + t the N-step lists are
    h head chunks, the same for every N;
    chunks h .. N - t - 1: the p chunks h .. h + p - 1 over and over, each repeat shifted by
        p steps (micro-batches by p * m);
    t tail chunks: those of the n-step lists with n in n0 .. n0 + p - 1 and n = N (mod p),
        shifted by N - n steps.
`find` measures h, p and t on short lists and then checks the claim on 3p + 3 lengths; the
chunks of any N are then made on demand, so a run of 100,000 steps costs no more to start
than one of 10. For a schedule where no (h, p, t) is found (p up to 4) `find` returns a
pattern that is not `periodic`: it makes each length's lists whole, as the schedule does.

Why validating a few lengths suffices (`instances`). Every check of `validate` is about
actions that lie close together: one stage's micro-batches in flight and its versions
alive, a step's backwards and its S, the actions of one micro-batch on related stages.
Let `span` be the largest number of consecutive chunks (of any GPU) holding the actions of
one micro-batch and the S actions of its step, plus the weight delay (measured on the
lists). A violation of a per-GPU check then lies within `span` consecutive chunks; a
deadlock is a cycle of GPUs, each stopped at an action that needs one at or after the next
one's stop, and following it from the GPU stopped earliest stays within G * span chunks
(G GPUs). Any window of W = G * span + 1 consecutive chunks of the N-step lists is a
shifted copy of a window of the n-step lists for the n of N's residue mod p as soon as
those have W + p steady chunks; the same waits (within the window) would stop the same
cycle there. So the lists of those p lengths, validated in full, vouch for every N.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field

from .actions import Action
from .base import Schedule, StageInfo

Chunk = tuple[tuple[Action, ...], ...]  # one step window: the actions of every GPU, by GPU

__all__ = ["Pattern", "shifted", "split_steps"]

MAX_PERIOD = 4


def shifted(a: Action, steps: int, m: int) -> Action:
    """The same action `steps` steps later (micro-batches move by steps * m)."""
    if not steps:
        return a
    mb = a.mb + (steps * m if a.spec.per_micro_batch else steps)
    return Action(a.kind, a.stage, mb, a.recompute)


def split_steps(acts: list[Action], stages_on_gpu: int) -> list[tuple[Action, ...]]:
    """One GPU's list cut after its last S of each step (every stage has one S per step)."""
    chunks, start, count = [], 0, {}
    for i, a in enumerate(acts):
        if a.kind == "S":
            count[a.mb] = count.get(a.mb, 0) + 1
            if count[a.mb] == stages_on_gpu:
                chunks.append(tuple(acts[start : i + 1]))
                start = i + 1
    if start != len(acts):
        chunks.append(tuple(acts[start:]))  # not well formed: `validate` says why
    return chunks


def _shift_chunk(chunk: Chunk, steps: int, m: int) -> Chunk:
    return tuple(tuple(shifted(a, steps, m) for a in acts) for acts in chunk)


@dataclass
class Pattern:
    schedule: Schedule
    stages: list[StageInfo]
    m: int
    h: int = 0
    p: int = 1
    t: int = 0
    periodic: bool = True
    _lists: dict[int, list[Chunk]] = field(default_factory=dict, repr=False)

    @property
    def gpus(self) -> list[int]:
        return sorted({s.gpu for s in self.stages})

    @property
    def n0(self) -> int:
        """The shortest length made from the pattern; shorter lists are the schedule's own."""
        return self.h + self.p + self.t if self.periodic else sys.maxsize

    def exact(self, n: int) -> list[Chunk]:
        """The schedule's own n-step lists as step windows (cached: short lengths only)."""
        if n not in self._lists:
            lists = self.schedule.actions(self.stages, self.m, n)
            per_gpu = {s.gpu: 0 for s in self.stages}
            for s in self.stages:
                per_gpu[s.gpu] += 1
            split = [split_steps(lists.get(g, []), per_gpu[g]) for g in self.gpus]
            windows = max(len(c) for c in split)
            self._lists[n] = [
                tuple(c[k] if k < len(c) else () for c in split) for k in range(windows)
            ]
        return self._lists[n]

    def window(self, k: int, steps: int) -> Chunk:
        """Step window k of the `steps`-step lists, every GPU's actions in it."""
        if steps < self.n0:
            return self.exact(steps)[k]
        if k < self.h:
            return self.exact(self.n0)[k]
        if k < steps - self.t:
            j = (k - self.h) % self.p
            return _shift_chunk(self.exact(self.n0)[self.h + j], k - self.h - j, self.m)
        n = self.n0 + (steps - self.n0) % self.p
        return _shift_chunk(self.exact(n)[k - (steps - n)], steps - n, self.m)

    def windows(self, steps: int) -> int:
        """How many step windows the `steps`-step lists have (more only when malformed)."""
        return len(self.exact(steps)) if steps < self.n0 else steps

    def lists(self, steps: int) -> dict[int, list[Action]]:
        """Whole lists (tests, and checking the pattern against the schedule)."""
        out: dict[int, list[Action]] = {g: [] for g in self.gpus}
        for k in range(self.windows(steps)):
            for g, acts in zip(self.gpus, self.window(k, steps), strict=True):
                out[g].extend(acts)
        return out

    @classmethod
    def find(cls, schedule: Schedule, stages: list[StageInfo], m: int) -> Pattern:
        pat = cls(schedule, list(stages), m)
        pols = schedule.policies(pat.stages, m)
        ahead = -(-max((p.in_flight for p in pols.values()), default=1) // m) + 1
        for p in range(1, MAX_PERIOD + 1):
            for a in (2 * ahead + 2 * p, 4 * ahead + 4 * p):
                found = pat._measure(a, p)
                if found is None:
                    continue
                pat.h, pat.p, pat.t = found
                lengths = [*range(pat.n0, pat.n0 + 3 * p + 1), a, a + p, a + 2 * p - 1]
                if all(pat._made(n) == pat.exact(n) for n in lengths):
                    return pat
        return cls(schedule, list(stages), m, periodic=False)

    def _measure(self, a: int, p: int) -> tuple[int, int, int] | None:
        """(h, p, t) as the lists of a .. a + 2p - 1 steps show them, or None."""
        t = 0
        for r in range(p):
            short, long = self.exact(a + r), self.exact(a + r + p)
            same, most = 0, min(len(short), len(long), a + r)
            while same < most and short[same] == long[same]:
                same += 1
            t = max(t, a + r - same)
        lists = self.exact(a + 2 * p - 1)
        h = len(lists) - t - p
        while h > 0 and lists[h - 1 + p] == _shift_chunk(lists[h - 1], p, self.m):
            h -= 1
        return (h, p, t) if h + p + t <= a else None

    def _made(self, n: int) -> list[Chunk]:
        return [self.window(k, n) for k in range(n)]

    def span(self, steps: int) -> int:
        """Most consecutive windows holding one micro-batch's actions and its step's S
        actions, plus the largest weight delay (see the module's doc)."""
        where: dict[int, list[int]] = {}  # step -> windows it touches
        for k in range(self.windows(steps)):
            for acts in self.window(k, steps):
                for a in acts:
                    step = a.mb // self.m if a.spec.per_micro_batch else a.mb
                    seen = where.setdefault(step, [k, k])
                    seen[0], seen[1] = min(seen[0], k), max(seen[1], k)
        pols = self.schedule.policies(self.stages, self.m)
        delay = max((p.weight_delay or 0 for p in pols.values()), default=0)
        return max((hi - lo + 1 for lo, hi in where.values()), default=1) + delay

    def instances(self) -> list[int]:
        """Lengths whose lists, valid in full, make every length valid (module doc)."""
        probe = self.n0 + 2 * self.p
        width = len(self.gpus) * self.span(probe) + 1
        first = self.h + self.t + width + self.p
        return [first + r for r in range(self.p)]
