"""What a partitioner is asked: a costed graph, the GPUs, and how they will be used.

problem = Problem(graph, gpus=8, hardware=get_hardware("rtx2080ti"), schedule="ftpipe",
                  optimizer="adafactor", micro_batches=10)
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from ftpipe_runtime.schedules import get_schedule

from ..errors import FtpipeError
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
        get_schedule(self.schedule)  # raises on an unknown name
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

    def node_work(self, node_id: str, last: bool = False) -> float:
        """Seconds per micro-batch; `last`: the node sits in the loss stage."""
        n = self.graph.node[node_id]
        return self.graph.work(n, recompute=self.sched.recompute(last))

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
        """No plan's period is below this: max(W / P', w_max).

        With a last stage that does not recompute, at most a fraction r of that stage's
        time is saved, so P' = P + r (r = the largest recompute share of any node).
        """
        g = self.graph
        total = sum(self.work_recompute.values())
        w_max = max(self.work_last.values(), default=0.0)
        r = 0.0
        if not self.sched.recompute(True):
            r = max(
                (n.recompute_s / g.work(n, True) for n in g.nodes if g.work(n, True) > 0),
                default=0.0,
            )
        return max(total / (self.gpus + r), w_max)
