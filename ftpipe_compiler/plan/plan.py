"""The plan: which stage runs every node, which GPU runs every stage, what crosses between.

    plan = build_plan(problem, stage_of={"linear": 0, ...}, gpu_of={0: 0, 1: 1}, partitioner="mixed")
    plan.validate(); plan.period_s; plan.to_dict(); Plan.from_dict(d); Plan.load(path)

`Plan` is the runtime's typed plan (ftpipe_runtime.spec.plan: the fields, the JSON, the one
reader and its structural checks) with its cost model's records for `cluster`, `reserve`
and `host`, and the figures computed from them (period, memory, speed-up).

Stages are renumbered in a topological order of the stage graph, so a stage only ever
receives from lower-numbered stages. The plan carries every figure the simulator needs
(stage times, bytes, memory), so `ftpipe simulate plan.json` needs nothing else.

Every parameter lives in one stage, its owner: the lowest-numbered stage that reads it.
Other stages reading it (T5's shared embedding in the decoder and the LM head) receive it
like an activation, a transfer named after the parameter, and send its gradient back, so
the owner's gradient is the sum over all uses (FTPipe: "model parameters and their
gradients can be communicated"). Owner -> reader edges go to higher stages, so the
numbering stays topological.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass, replace

from ftpipe_runtime.atomic import write_atomic
from ftpipe_runtime.errors import PipelineConfigError
from ftpipe_runtime.schedules import ScheduleError, StagePolicy, resolve_schedule
from ftpipe_runtime.spec import plan as spec

from ..costs.cluster import Cluster
from ..costs.formulas import PRECISIONS, MemoryReserve, param_bytes, period_s, stage_memory
from ..costs.gpu_memory import GpuMemory, MemoryView, gpu_memory
from ..costs.host import Host, host_memory, stage_device_sum_bytes, sums_apart
from ..errors import FtpipeError, PlanFormatError
from ..units import mib
from ..version import __version__
from .checks import check_plan
from .parts import PlanParam, Stage


@dataclass(frozen=True)
class Plan(spec.Plan):
    # The runtime's fields, with the cost model's records where it keeps JSON objects (a
    # field named again keeps its place: the JSON's order is the runtime's).
    cluster: Cluster | None = None  # the nodes and links the plan was made for
    # What each GPU holds besides the run's tensors (the hardware's context, communicators).
    reserve: MemoryReserve = MemoryReserve()
    # The host memory, link and CPUs offloaded stages use (the hardware's `host`, resolved).
    host: Host = Host()
    version: str = __version__
    # Cluster.from_json says what is wrong with a cluster as an FtpipeError.
    DAMAGED = (*spec.Plan.DAMAGED, FtpipeError)

    # --- figures ---
    def gpu_compute_s(self, gpu: int) -> float:
        return sum(s.compute_s for s in self.stages_on(gpu))

    def gpu_work_s(self) -> dict[int, float]:
        """GPU -> the seconds its stages compute per micro-batch (forward, backward and the
        recompute its schedule's policies ask for), as the simulator runs them."""
        policies, work = self.policies, {}
        for s in self.stages:
            work[s.gpu] = work.get(s.gpu, 0.0) + s.work_s(policies[s.id].recompute)
        return work

    def gpu_comm_s(self, gpu: int) -> tuple[float, float]:
        """(forward bytes sent, gradient bytes sent) / bandwidth, each tensor once per GPU."""
        gpu_of = {s.id: s.gpu for s in self.stages}
        fwd = bwd = 0
        for t in self.transfers:
            dests = {gpu_of[c] for c in t.consumers} - {gpu_of[t.producer]}
            if gpu_of[t.producer] == gpu:
                fwd += t.bytes * len(dests)
            elif gpu in dests and t.requires_grad:
                bwd += t.bytes
        return fwd / self.bandwidth, bwd / self.bandwidth

    def gpu_period_s(self, gpu: int) -> float:
        """FTPipe eq. 1 with all stages of the GPU summed: compute, plus what transfers do not hide."""
        return period_s(self.gpu_compute_s(gpu), *self.gpu_comm_s(gpu))

    @property
    def period_s(self) -> float:
        return max(self.gpu_period_s(g) for g in range(self.gpus))

    @property
    def expected_speedup(self) -> float:
        """Total compute / the slowest GPU's period: how many GPUs the plan keeps busy."""
        total = sum(s.compute_s for s in self.stages)
        return total / self.period_s if self.period_s > 0 else 0.0

    @property
    def comm_bytes(self) -> int:
        """Bytes crossing between GPUs per micro-batch, forward and backward."""
        gpu_of = {s.id: s.gpu for s in self.stages}
        total = 0
        for t in self.transfers:
            dests = len({gpu_of[c] for c in t.consumers} - {gpu_of[t.producer]})
            total += t.bytes * dests * (2 if t.requires_grad else 1)
        return total

    def weight_owners(self) -> set[int]:
        """Stages that send one of their parameters to other stages (a tied weight's owner)."""
        params = {p.name for p in self.params}
        return {t.producer for t in self.transfers if t.tensor in params}

    @functools.cached_property
    def policies(self) -> dict[int, StagePolicy]:
        """What every stage keeps under the plan's schedule."""
        try:
            sched = resolve_schedule(self.schedule, self.recompute)
        except ScheduleError as e:
            raise FtpipeError(str(e)) from None
        return sched.policies(self.stage_infos(), self.micro_batches)

    @functools.cached_property
    def sums_apart(self) -> frozenset[int]:
        """Stages whose offloaded step may hold a second gradient sum (`costs.host.sums_apart`),
        found once: every memory figure of the plan asks."""
        return sums_apart(self)

    def gpu_memory(
        self, gpu: int, in_flight: dict[int, int] | None = None, deferred: dict | None = None,
        apart=None,
    ) -> int:  # fmt: skip
        """Peak bytes on a GPU (`costs.gpu_memory`: its stages, the runtime's messages and
        buffers, the device's reserve); micro-batches in flight (and, split, between B and W)
        per stage, and the stages holding a second gradient sum, from the schedule unless
        given (the simulator's)."""
        if in_flight or deferred or apart is not None:
            return self.gpu_memory_parts(gpu, in_flight, deferred, apart).total
        got = self._peaks.get(gpu)
        if got is None:
            got = self._peaks[gpu] = self.gpu_memory_parts(gpu).total
        return got

    @functools.cached_property
    def _peaks(self) -> dict[int, int]:
        """GPU -> its `gpu_memory` under the schedule's own counts, made once: a partitioner
        checks its plan (partition/fit.py), then `validate`, reports and the planner ask."""
        return {}

    def gpu_memory_parts(
        self, gpu: int, in_flight: dict[int, int] | None = None, deferred: dict | None = None,
        apart=None,
    ) -> GpuMemory:  # fmt: skip
        """The same peak, by what holds it."""
        return gpu_memory(self, gpu, in_flight, deferred, view=self._memory_view, apart=apart)

    @functools.cached_property
    def _memory_view(self) -> MemoryView:
        """Who sends what to whom, made once: `gpu_memory` asks it for every GPU and peak."""
        return MemoryView(self)

    def __getstate__(self) -> dict:
        # The view keys its transfers by id(), which a pickle (a search's worker) does not keep.
        return {k: v for k, v in self.__dict__.items() if k != "_memory_view"}

    def stage_memory(
        self, s: Stage, in_flight: dict[int, int] | None = None, deferred: dict | None = None
    ) -> tuple[int, int]:
        """(bytes the stage holds throughout, bytes it needs on top while one backward runs)."""
        policy = self.policies[s.id]
        if in_flight:
            policy = replace(policy, in_flight=in_flight[s.id])
        if deferred:
            policy = replace(policy, deferred=deferred[s.id])
        owned = [self._param_by_name[n] for n in s.params]
        return stage_memory(
            trainable_bytes=sum(p.bytes for p in owned if p.trainable),
            frozen_bytes=sum(p.bytes for p in owned if not p.trainable),
            state_bytes=self.state_bytes(s),
            input_bytes=0 if s.forward_only else s.input_bytes,
            act_bytes=s.act_bytes,
            policy=policy,
            offload=s.offload,
            device_sums=stage_device_sum_bytes(self, s),
        )

    def state_bytes(self, s: Stage) -> int:
        """Bytes of the gradients, masters and optimizer state of stage s's parameters on
        each of its GPUs: 1/replicas of the masters and state where it shards them."""
        owned = [self._param_by_name[n] for n in s.params]
        d = s.sharded_over(self.replicas)
        if d == 1:
            return sum(p.static_bytes - p.bytes for p in owned)
        precision = PRECISIONS[self.model.get("precision") or "fp32"]
        return sum(
            param_bytes(p.shape, p.dtype, p.trainable, self.optimizer, precision, d)[1]
            for p in owned
        )

    @functools.cached_property
    def _param_by_name(self) -> dict[str, PlanParam]:
        return {p.name: p for p in self.params}

    @property
    def max_memory_bytes(self) -> int:
        return max(self.gpu_memory(g) for g in range(self.gpus))

    @property
    def feasible(self) -> bool:
        """Every GPU within its memory, and every node's host within its own."""
        return self.max_memory_bytes <= self.memory_bytes and self.host_fits

    @property
    def host_fits(self) -> bool:
        """What the stages offload fits each node's host memory (`costs.host.host_memory`)."""
        return all(b <= self.host.memory_bytes for b in host_memory(self).values())

    @property
    def idle_gpus(self) -> list[int]:
        """GPUs the plan gives no stage: a runtime rank there would have nothing to do."""
        used = {s.gpu for s in self.stages}
        return [g for g in range(self.gpus) if g not in used]

    def compacted(self) -> Plan:
        """The same plan on only the GPUs it uses, numbered in order (figures are unchanged)."""
        used = sorted({s.gpu for s in self.stages})
        if len(used) == self.gpus:
            return self
        if self.replicas > 1:
            raise FtpipeError("compact a plan before replicating it")
        new = {g: i for i, g in enumerate(used)}
        stages = tuple(replace(s, gpu=new[s.gpu]) for s in self.stages)
        return replace(self, gpus=len(used), stages=stages)

    # --- checks ---
    def validate(self, memory: bool = True) -> None:
        """The runtime's structural checks (`ftpipe_runtime.spec.plan.check_plan`: stages,
        transfers, schedule, placement) and, with `memory`, every GPU and host within its
        memory (plan/checks.py). A plan read from a file is checked without memory.
        Raises FtpipeError naming the first thing wrong."""
        check_plan(self, memory=memory)

    # --- serialisation ---
    def to_dict(self) -> dict:
        """The runtime's JSON, with the figures the compiler computes as its `summary`."""
        d = super().to_dict()
        d["summary"] = {
            "period_s": self.period_s,
            "expected_speedup": self.expected_speedup,
            "max_memory_bytes": self.max_memory_bytes,
            "comm_bytes": self.comm_bytes,
            "feasible": self.feasible,
        }
        return d

    @classmethod
    def from_dict(cls, d) -> Plan:
        """`spec.Plan.from_dict` (read and checked there), its errors as PlanFormatError."""
        try:
            return super().from_dict(d)
        except PipelineConfigError as e:
            raise PlanFormatError(str(e)) from None

    def save(self, path) -> None:
        write_atomic(path, json.dumps(self.to_dict(), indent=1))

    @classmethod
    def load(cls, path) -> Plan:
        """Read and check a plan file as the runtime does (`spec.Plan.read`, the one reader:
        structure, not memory: `simulate` shows what overflows), so a plan `simulate`
        accepts is one a package runs, and one it refuses is refused in the same words."""
        try:
            return cls.read(path)
        except PipelineConfigError as e:  # an unreadable file: the runtime's sentence
            raise PlanFormatError(str(e)) from None

    def with_(self, **changes) -> Plan:
        return replace(self, **changes)


def describe_remat(plan: Plan) -> str:
    """One line for people: which stages recompute how many nodes, and the bytes saved; ""
    when no stage recomputes anything."""
    copies = {s.id: len(s.copies) for s in plan.stages if s.copies}
    if not copies:
        return ""
    where = ", ".join(f"{n} in stage {s}" for s, n in copies.items())
    return (
        f"recomputed instead of sent: {sum(copies.values())} nodes ({where}); "
        f"{mib(plan.remat_saved_bytes):.2f} MiB per micro-batch no longer crosses between GPUs"
    )
