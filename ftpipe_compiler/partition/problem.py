"""What a partitioner is asked: a costed graph, the GPUs, and how they will be used.

problem = Problem(graph, gpus=8, hardware=get_hardware("rtx2080ti"), schedule="ftpipe",
                  optimizer="adafactor", micro_batches=10)
"""

from __future__ import annotations

import bisect
import functools
import itertools
import math
from dataclasses import dataclass

from ftpipe_runtime.schedules import SCHEDULES, get_schedule

from ..errors import FtpipeError, unknown
from ..graph import OpGraph
from ..hardware import Hardware
from ..memory import OPTIMIZERS, optimizer_state_bytes


@dataclass(frozen=True)
class Problem:
    graph: OpGraph
    gpus: int
    hardware: Hardware
    schedule: str = "ftpipe"
    optimizer: str = "adamw"
    micro_batches: int = 4  # per optimizer step (GPipe / 1F1B flush size)
    seed: int = 0
    memory_bytes: int = 0  # 0: the hardware's memory

    def __post_init__(self):
        if self.gpus < 1:
            raise FtpipeError(f"--gpus must be at least 1, not {self.gpus}")
        if self.optimizer not in OPTIMIZERS:
            raise FtpipeError(
                f"unknown optimizer {self.optimizer!r}; choose from {', '.join(OPTIMIZERS)}"
            )
        if self.schedule not in SCHEDULES:
            raise unknown("schedule", self.schedule, SCHEDULES)
        if self.graph.profile == "none":
            raise FtpipeError("the graph has no costs; profile it first (ftpipe profile)")

    @property
    def memory(self) -> int:
        return self.memory_bytes or self.hardware.memory_bytes

    @property
    def bandwidth(self) -> float:
        return self.hardware.link_bandwidth

    @functools.cached_property
    def sched(self):
        return get_schedule(self.schedule)

    @functools.cached_property
    def work_recompute(self) -> dict[str, float]:
        return {n.id: self.graph.work(n, True) for n in self.graph.nodes}

    @functools.cached_property
    def work_last(self) -> dict[str, float]:
        rec = self.sched.recompute(True)
        return {n.id: self.graph.work(n, rec) for n in self.graph.nodes}

    @functools.cached_property
    def static_bytes(self) -> dict[str, int]:
        """Weights + gradients + optimizer state of each parameter."""
        out = {}
        for p in self.graph.params:
            grad = p.bytes if p.trainable else 0
            opt = optimizer_state_bytes(p.shape, p.bytes, self.optimizer) if p.trainable else 0
            out[p.name] = p.bytes + grad + opt
        return out

    @functools.cached_property
    def node_static_bytes(self) -> dict[str, int]:
        """Static bytes owned by each node (tied parameters at their first reader)."""
        out = {n.id: 0 for n in self.graph.nodes}
        for p, nid in self.graph.owner.items():
            out[nid] += self.static_bytes[p]
        return out

    def lower_bound(self) -> float:
        """No plan's period is below this: max(w_max, the least T with P*T + saved(T) >= W).

        W is the total work with recompute everywhere. A loss stage that does not recompute
        saves its nodes' recompute time; on one GPU of period T it saves at most saved(T),
        a fractional knapsack of the nodes with the best recompute/(forward+backward) ratio
        filling T. Without that saving this is the classic max(W / P, w_max).
        """
        g = self.graph
        total = sum(self.work_recompute.values())
        w_max = max(self.work_last.values(), default=0.0)
        if self.sched.recompute(True):
            return max(total / self.gpus, w_max)
        items = sorted(
            ((n.recompute_s, n.fwd_s + n.bwd_s) for n in g.nodes if n.recompute_s > 0),
            key=lambda x: -x[0] / x[1] if x[1] > 0 else -math.inf,
        )
        cost = list(itertools.accumulate(c for _, c in items))
        gain = list(itertools.accumulate(r for r, _ in items))

        def saved(t: float) -> float:
            k = bisect.bisect_right(cost, t)
            done = gain[k - 1] if k else 0.0
            if k < len(items) and items[k][1] > 0:
                done += items[k][0] * (t - (cost[k - 1] if k else 0.0)) / items[k][1]
            return done

        lo, hi = total / (self.gpus + 1), total / self.gpus
        for _ in range(60):
            mid = (lo + hi) / 2
            lo, hi = (lo, mid) if self.gpus * mid + saved(mid) >= total else (mid, hi)
        return max(hi, w_max)
