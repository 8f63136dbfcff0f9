"""What a partitioner is asked: a costed graph, the GPUs, and how they will be used.

problem = Problem(graph, gpus=8, hardware=get_hardware("rtx2080ti"), schedule="ftpipe",
                  optimizer="adafactor", micro_batches=10)
problem.policy(stage_info)        # what a stage keeps under the schedule (StagePolicy)
problem.chain_stage(depth=2, is_last=False, length=8)   # a chain position as the schedule sees it
"""

from __future__ import annotations

import bisect
import functools
import itertools
import math
from dataclasses import dataclass, replace

from ftpipe_runtime.engine.comm import POST_AHEAD_BYTES, POST_AHEAD_MESSAGES
from ftpipe_runtime.errors import unknown_name
from ftpipe_runtime.schedules import SCHEDULES, Schedule, ScheduleError, StageInfo, StagePolicy
from ftpipe_runtime.spec.plan import OFFLOAD_STEPS
from ftpipe_runtime.train.precision import get_precision

from ..costs.formulas import ACTIVATIONS_ON_GPU, FP32, OPTIMIZERS, Precision, param_bytes
from ..costs.hardware import Hardware
from ..errors import FtpipeError, unknown
from ..graph.opgraph import OpGraph
from ..units import size

OFFLOAD_MODES = ("none", "auto", "optimizer", "activations")  # planner/offload.py's MODES


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
    precision: Precision = FP32
    recompute: bool = True  # False: every stage keeps its activations (where the schedule may)
    link_bandwidth: float = 0.0  # between the pipeline's GPUs; 0: the hardware's
    # Stages recompute cheap tensors made from inputs and weights alone instead of receiving
    # them (partition/remat): on for real models (`problem_from_graph`, the planner).
    rematerialise: bool = False
    # What stages may keep in host memory (planner/offload.py's modes): "none"; "optimizer",
    # "activations" (every stage); "auto" (either, where a GPU needs it). The partitioners
    # count a GPU's memory as if every stage offloaded what the mode allows
    # (`gpu_param_split`, `policy`); `planner.offload.choose_offload` then decides per stage.
    offload: str = "none"
    # Where an offloaded stage's step lands (the plan's `OFFLOAD_STEPS`): set on the stages
    # that offload their optimizer under FTPipe's schedule (`choose_offload`).
    offload_step: str = "exact"
    # Replicas a stage's masters and optimizer state may be sharded across (ZeRO-1; 1:
    # none): the partitioners count 1/shard_over of them on a GPU (`gpu_param_split`);
    # `planner.offload.choose_offload` then shards per stage only where a GPU needs it.
    shard_over: int = 1

    def __post_init__(self):
        if self.gpus < 1:
            raise FtpipeError(f"--gpus must be at least 1, not {self.gpus}")
        if self.gpus > len(self.graph.nodes):  # each GPU used holds a node at least: the plan
            object.__setattr__(self, "gpus", max(1, len(self.graph.nodes)))  # keeps to those
        if self.optimizer not in OPTIMIZERS:
            raise FtpipeError(unknown_name("optimizer", self.optimizer, OPTIMIZERS))
        if self.schedule not in SCHEDULES:
            raise unknown("schedule", self.schedule, SCHEDULES)
        if get_precision(self.precision.name).loss_scaling and not self.sched.synchronous:
            raise FtpipeError(  # the runtime refuses it (precision.for_run): plan none
                f"--dtype {self.precision.name} scales the loss by a factor all stages change "
                f"together, and {self.schedule} does not step them together; plan it under a "
                "synchronous schedule (gpipe, 1f1b, zb1p...) or use bf16"
            )
        if not self.recompute and not SCHEDULES[self.schedule].can_keep_activations:
            raise FtpipeError(f"{self.schedule} must recompute; plan it with recompute")
        try:
            chain = self.sched.placement.chain(self.gpus) if self.patterned else []
            self.sched.check(chain, self.micro_batches)
        except ScheduleError as e:
            raise FtpipeError(str(e)) from None
        if self.graph.profile == "none":
            raise FtpipeError("the graph has no costs; profile it first (ftpipe profile)")
        if self.offload not in OFFLOAD_MODES:
            raise FtpipeError(unknown_name("offload", self.offload, OFFLOAD_MODES))
        if self.offload_step not in OFFLOAD_STEPS:
            raise FtpipeError(unknown_name("offload step", self.offload_step, OFFLOAD_STEPS))

    @property
    def capacity(self) -> int:
        """Bytes of one GPU: `memory_bytes`, or the hardware's."""
        return self.memory_bytes or self.hardware.memory_bytes

    @functools.cached_property
    def memory(self) -> int:
        """What the partitioners may fill with their stages on one GPU: its capacity less the
        device's reserve (a GPU exchanging messages with two neighbours both ways), the largest
        gradient a backward makes before adding it in, and the receive buffers two neighbours'
        messages keep posted (at most the runtime's window of the largest ones). The plan then
        counts its own communicators and buffers (`Plan.gpu_memory`); where a GPU is over, the
        partitioners cut again within the room the plan left it (partition/fit.py); what does
        not fit then is no plan."""
        pairs = min(4, 2 * (self.gpus - 1))
        usable = self.hardware.memory_reserve.usable(self.capacity, pairs + 1)
        largest = max((w for w, s in self.param_split.values() if s), default=0)
        message = max((n.out_bytes for n in self.graph.nodes), default=0)
        posted = min(2, self.gpus - 1) * min(POST_AHEAD_BYTES, POST_AHEAD_MESSAGES * message)
        return max(0, usable - largest - posted)

    def memory_said(self) -> str:
        """`memory` as printed: '10.6 GiB (11.0 GiB less the device's reserve)'."""
        if self.memory < self.capacity:
            return f"{size(self.memory)} ({size(self.capacity)} less the device's reserve)"
        return size(self.memory)

    @property
    def bandwidth(self) -> float:
        return self.link_bandwidth or self.hardware.link_bandwidth

    @functools.cached_property
    def sched(self) -> Schedule:
        sched = SCHEDULES[self.schedule]
        return sched if self.recompute else sched.without_recompute()

    @property
    def patterned(self) -> bool:
        """Does the schedule fix the placement (WPipe's loop) rather than leave it free?"""
        return not self.sched.placement.free

    @property
    def per_gpu(self) -> int:
        """Stages per GPU the schedule's pattern asks for (1 when the placement is free)."""
        return self.sched.placement.per_gpu or 1

    @property
    def chain_length(self) -> int:
        """Stages a sequential partitioner cuts: one per GPU, or the pattern's count."""
        return self.per_gpu * self.gpus

    def policy(self, st: StageInfo) -> StagePolicy:
        """What a stage keeps under the schedule (cached: partitioners ask in inner loops);
        where activations may be offloaded, on the GPU: at most `ACTIVATIONS_ON_GPU`
        micro-batches in flight."""
        got = self._policies.get(st)
        if got is None:
            got = self.sched.policy(st, self.micro_batches, self.gpus)
            if self._frees("activations") and got.in_flight > ACTIVATIONS_ON_GPU:
                got = replace(got, in_flight=ACTIVATIONS_ON_GPU)
            self._policies[st] = got
        return got

    @functools.cached_property
    def _policies(self) -> dict[StageInfo, StagePolicy]:
        return {}

    def chain_stage(self, depth: int, is_last: bool, length: int) -> StageInfo:
        """Stage `depth` from the end of a chain of `length` stages: in the schedule's
        pattern when it has one, else one stage per GPU."""
        pos = length - 1 - depth
        if self.patterned:
            st = self.sched.placement.chain(self.gpus)[pos]
            return StageInfo(st.id, st.gpu, depth, is_last, st.chunk)
        return StageInfo(pos, pos, depth, is_last)

    @functools.cached_property
    def loss_recomputes(self) -> bool:
        return self.policy(self.chain_stage(0, True, self.chain_length)).recompute

    @functools.cached_property
    def work_recompute(self) -> dict[str, float]:
        """Work of each node in a stage other than the loss stage: with its recompute, unless
        the problem keeps activations."""
        return {n.id: self.graph.work(n, self.recompute) for n in self.graph.nodes}

    @functools.cached_property
    def work_last(self) -> dict[str, float]:
        rec = self.loss_recomputes
        return {n.id: self.graph.work(n, rec) for n in self.graph.nodes}

    @functools.cached_property
    def param_split(self) -> dict[str, tuple[int, int]]:
        """(one copy of the weight, its gradient and optimizer state) of each parameter."""
        return {
            p.name: param_bytes(p.shape, p.dtype, p.trainable, self.optimizer, self.precision)
            for p in self.graph.params
        }

    def _frees(self, kind: str) -> bool:
        """May stages offload `kind` to free GPU memory? Not where the device is the host."""
        return self.offload in ("auto", kind) and not self.hardware.host.device_is_host

    @functools.cached_property
    def gpu_param_split(self) -> dict[str, tuple[int, int]]:
        """`param_split` as the partitioners count a GPU: where the optimizer may be offloaded,
        a trainable parameter's gradient and optimizer state are on the host; where it may be
        sharded across `shard_over` replicas, 1/shard_over of its masters and state here."""
        if self._frees("optimizer"):
            return {name: (w, 0) for name, (w, _) in self.param_split.items()}
        if self.shard_over > 1:
            return {
                p.name: param_bytes(p.shape, p.dtype, p.trainable, self.optimizer,
                                    self.precision, self.shard_over)
                for p in self.graph.params
            }  # fmt: skip
        return self.param_split

    @functools.cached_property
    def static_bytes(self) -> dict[str, int]:
        """Weights (one version) + gradients + optimizer state of each parameter."""
        return {name: w + s for name, (w, s) in self.param_split.items()}

    def lower_bound(self) -> float:
        """No plan's period is below this: max(w_max, the least T with P*T + saved(T) >= W).

        W is the total work with recompute everywhere. A loss stage that does not recompute
        saves per node its work recomputing less its work keeping; on one GPU of period T it
        saves at most saved(T), a fractional knapsack of the nodes with the best saving/work
        ratio filling T. Without that saving this is the classic max(W / P, w_max).
        """
        total = sum(self.work_recompute.values())
        w_max = max(self.work_last.values(), default=0.0)
        if self.loss_recomputes or not self.recompute:
            return max(total / self.gpus, w_max)
        items, cost, gain = self.graph.derived("recompute_savings", _savings)

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


def _savings(g: OpGraph) -> tuple[list, list, list]:
    """(saving, work) of the nodes that save by not recomputing, best ratio first, and the
    running sums of their work and savings: `Problem.lower_bound`'s knapsack, the same under
    every schedule."""
    pairs = ((g.work(n, True) - g.work(n, False), g.work(n, False)) for n in g.nodes)
    items = sorted(
        ((gain, work) for gain, work in pairs if gain > 0),
        key=lambda x: -x[0] / x[1] if x[1] > 0 else -math.inf,
    )
    cost = list(itertools.accumulate(c for _, c in items))
    gain = list(itertools.accumulate(r for r, _ in items))
    return items, cost, gain
