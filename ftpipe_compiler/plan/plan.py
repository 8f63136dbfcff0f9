"""The plan: which stage runs every node, which GPU runs every stage, what crosses between.

    plan = build_plan(problem, stage_of={"linear": 0, ...}, gpu_of={0: 0, 1: 1}, partitioner="mixed")
    plan.validate(); plan.period_s; plan.to_json(); Plan.from_json(d)

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
from dataclasses import asdict, dataclass, field, fields, replace

from ftpipe_runtime.atomic import write_atomic
from ftpipe_runtime.errors import PipelineConfigError
from ftpipe_runtime.schedules import (
    ScheduleError,
    StageInfo,
    StagePolicy,
    resolve_schedule,
    with_chunks,
)
from ftpipe_runtime.spec.topology import Topology

from ..costs.cluster import Cluster
from ..costs.formulas import MemoryReserve, period_s, stage_memory
from ..costs.gpu_memory import GpuMemory, gpu_memory
from ..costs.host import Host, Offload, host_memory
from ..errors import FtpipeError, PlanFormatError
from ..graph.opgraph import _typed, read_json
from ..units import mib
from ..version import PLAN_FORMAT, READABLE_FORMATS, __version__
from .checks import check_plan
from .parts import PlanParam, Stage, Transfer


@dataclass(frozen=True)
class Plan:
    partitioner: str
    gpus: int
    schedule: str
    micro_batches: int
    optimizer: str
    bandwidth: float
    memory_bytes: int  # per GPU
    stages: tuple[Stage, ...]
    transfers: tuple[Transfer, ...]
    params: tuple[PlanParam, ...]
    loss_stage: int
    lower_bound_s: float = 0.0
    search_seconds: float = 0.0
    # Everything about where the plan came from, for the reader and the code generator.
    model: dict = field(default_factory=dict)  # spec, task, micro_batch, inputs, family, hardware
    competitors: tuple[dict, ...] = ()
    simulated: dict = field(default_factory=dict)
    command: str = ""
    recompute: bool = True  # False: every stage keeps its activations (the planner's choice)
    # Data parallelism: `replicas` copies of the pipeline; rank r of the job runs GPU
    # placement[r][1] of replica placement[r][0] (() : one replica, rank = GPU).
    replicas: int = 1
    placement: tuple[tuple[int, int], ...] = ()
    cluster: Cluster | None = None  # the nodes and links the plan was made for
    # Per micro-batch: bytes (activations and their gradients) that stages' `copies` keep
    # from crossing between GPUs (partition/remat); the weights the copies read travel instead.
    remat_saved_bytes: int = 0
    # The machine's point-to-point message cost beside `bandwidth` (Hardware.link_latency_s).
    latency_s: float = 0.0
    # What each GPU holds besides the run's tensors (the hardware's context, communicators).
    reserve: MemoryReserve = MemoryReserve()
    # The host memory, link and CPUs offloaded stages use (the hardware's `host`, resolved).
    host: Host = Host()
    version: str = __version__

    # --- where the ranks are ---
    @property
    def world(self) -> int:
        """Processes the plan runs on: every GPU of every replica."""
        return self.replicas * self.gpus

    def placed(self) -> tuple[tuple[int, int], ...]:
        """(replica, GPU of the pipeline) of every rank."""
        return self.placement or tuple((0, g) for g in range(self.gpus))

    # --- figures ---
    def stages_on(self, gpu: int) -> list[Stage]:
        return [s for s in self.stages if s.gpu == gpu]

    def gpu_compute_s(self, gpu: int) -> float:
        return sum(s.compute_s for s in self.stages_on(gpu))

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

    def stage_infos(self) -> list[StageInfo]:
        """The stages as a schedule sees them (GPU, depth, loss, chunk)."""
        return with_chunks(
            StageInfo(s.id, s.gpu, s.depth, s.id == self.loss_stage) for s in self.stages
        )

    @functools.cached_property
    def policies(self) -> dict[int, StagePolicy]:
        """What every stage keeps under the plan's schedule."""
        try:
            sched = resolve_schedule(self.schedule, self.recompute)
        except ScheduleError as e:
            raise FtpipeError(str(e)) from None
        return sched.policies(self.stage_infos(), self.micro_batches)

    def gpu_memory(
        self, gpu: int, in_flight: dict[int, int] | None = None, deferred: dict | None = None
    ) -> int:
        """Peak bytes on a GPU (`costs.gpu_memory`: its stages, the runtime's messages and
        buffers, the device's reserve); micro-batches in flight (and, split, between B and W)
        per stage from the schedule unless given."""
        return self.gpu_memory_parts(gpu, in_flight, deferred).total

    def gpu_memory_parts(
        self, gpu: int, in_flight: dict[int, int] | None = None, deferred: dict | None = None
    ) -> GpuMemory:
        """The same peak, by what holds it."""
        return gpu_memory(self, gpu, in_flight, deferred)

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
            state_bytes=sum(p.static_bytes - p.bytes for p in owned),
            input_bytes=0 if s.forward_only else s.input_bytes,
            act_bytes=s.act_bytes,
            policy=policy,
            offload=s.offload,
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
        """Every node in one stage, stages numbered 0..n-1 on existing GPUs, transfers and
        parameters between existing stages, stage graph acyclic, stages placed as the schedule
        needs; with `memory`, every GPU within its memory. A plan read from a file is checked
        without memory. Raises FtpipeError naming the first thing wrong (plan/checks.py)."""
        check_plan(self, memory=memory)

    # --- serialisation ---
    def to_json(self) -> dict:
        d = asdict(self)
        d = {"format": PLAN_FORMAT, "kind": "ftpipe-plan", **d}
        d["cluster"] = self.cluster.to_json() if self.cluster else None
        d["summary"] = {
            "period_s": self.period_s,
            "expected_speedup": self.expected_speedup,
            "max_memory_bytes": self.max_memory_bytes,
            "comm_bytes": self.comm_bytes,
            "feasible": self.feasible,
        }
        return d

    @classmethod
    def from_json(cls, d: dict) -> Plan:
        if not isinstance(d, dict) or d.get("kind") != "ftpipe-plan":
            raise PlanFormatError(
                "this file is not an ftpipe plan; make one with `ftpipe partition` or `ftpipe compile`"
            )
        if d.get("format") not in READABLE_FORMATS:
            raise PlanFormatError(
                f"plan format {d.get('format')} was written by ftpipe {d.get('version', '?')}; this "
                f"ftpipe reads formats {' and '.join(map(str, READABLE_FORMATS))}: run `ftpipe compile` "
                "again with this version"
            )
        nested = ("stages", "transfers", "params", "cluster", "reserve", "host")
        flat = [f.name for f in fields(cls) if f.name not in nested]
        try:
            plan = _typed(
                cls,
                {k: d[k] for k in flat if k in d}
                | {
                    "stages": tuple(_stage(s) for s in d["stages"]),
                    "transfers": tuple(_typed(Transfer, t) for t in d["transfers"]),
                    "params": tuple(_typed(PlanParam, p) for p in d["params"]),
                    "cluster": Cluster.from_json(d["cluster"]) if d.get("cluster") else None,
                    "reserve": _typed(MemoryReserve, d.get("reserve") or {}),
                    "host": _typed(Host, d.get("host") or {}),
                },
            )
        except (KeyError, TypeError, ValueError, AttributeError, FtpipeError) as e:
            raise PlanFormatError(
                f"the plan file is incomplete or damaged ({type(e).__name__}: {e}); write it "
                "again with `ftpipe compile`"
            ) from None
        copied = [p.name for p in plan.params if len(p.stages) > 1]
        if copied:
            raise PlanFormatError(
                f"this plan copies {copied[0]} into several stages (ftpipe before weights were "
                "sent between stages); run `ftpipe compile` again"
            )
        return plan

    def save(self, path) -> None:
        write_atomic(path, json.dumps(self.to_json(), indent=1))

    @classmethod
    def load(cls, path) -> Plan:
        """Read and check a plan file (structure, not memory: `simulate` shows what overflows).
        Read as the runtime reads it, and held to the runtime's checks after the compiler's
        own (a superset, with the compiler's wording), so a plan `simulate` accepts is one a
        package runs."""
        d = read_json(path, "plan")
        plan = cls.from_json(d)
        try:
            plan.validate(memory=False)
            Topology(d)
        except (FtpipeError, PipelineConfigError) as e:
            raise PlanFormatError(f"{path} is not a valid plan: {e}") from None
        return plan

    def with_(self, **changes) -> Plan:
        return replace(self, **changes)


def _stage(d: dict) -> Stage:
    """A stage from JSON, its `offload` object (absent in plans before offload: none)."""
    if not isinstance(d, dict):
        raise TypeError(f"a Stage must be a JSON object, not {type(d).__name__}")
    return _typed(Stage, {**d, "offload": _typed(Offload, d.get("offload") or {})})


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
