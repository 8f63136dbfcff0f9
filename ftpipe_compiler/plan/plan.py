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
import math
from dataclasses import asdict, dataclass, field, fields, replace

import networkx as nx
from ftpipe_runtime.atomic import write_atomic
from ftpipe_runtime.schedules import (
    ScheduleError,
    StageInfo,
    StagePolicy,
    resolve_schedule,
    with_chunks,
)

from ..costs.cluster import Cluster
from ..costs.formulas import gpu_memory_bytes, period_s, stage_memory
from ..errors import FtpipeError, PlanFormatError, unknown
from ..graph.opgraph import _typed, read_json
from ..version import PLAN_FORMAT, READABLE_FORMATS, __version__


@dataclass(frozen=True)
class Stage:
    id: int
    gpu: int
    nodes: tuple[str, ...]  # graph node ids, in execution order
    fwd_s: float
    bwd_s: float  # the whole backward: input and weight gradients
    recompute_s: float
    recompute: bool  # does this stage recompute under the plan's schedule?
    depth: int  # stages on the longest path from here to the loss stage
    params: tuple[str, ...]  # canonical names of the parameters it owns
    inputs: tuple[str, ...]  # transfers received (producer node ids, or parameter names)
    outputs: tuple[str, ...]  # transfers sent (its nodes, or parameters it owns)
    model_inputs: tuple[str, ...]  # model inputs read straight from the data
    input_bytes: int  # per micro-batch: transfers received + model inputs
    act_bytes: int  # per micro-batch: activations kept for backward without recompute
    wgrad_s: float = 0.0  # the part of bwd_s a split backward's W runs (weight gradients)
    # Nodes of other stages it recomputes instead of receiving their outputs (partition/remat;
    # their costs are in the figures above), in graph order.
    copies: tuple[str, ...] = ()
    # Nothing trainable in it or before it: no backward, nothing kept (ftpipe_runtime.frozen).
    forward_only: bool = False
    # Its optimizer step (formulas.optimizer_step_s of the parameters it owns; 0: free).
    step_s: float = 0.0

    @property
    def compute_s(self) -> float:
        return self.fwd_s + self.bwd_s + (self.recompute_s if self.recompute else 0.0)


@dataclass(frozen=True)
class Transfer:
    tensor: str  # producing node id, or a parameter's canonical name (sent by its owner)
    producer: int  # stage
    consumers: tuple[int, ...]  # stages
    shape: tuple[int, ...]
    dtype: str
    bytes: int
    requires_grad: bool  # a gradient flows back along it


@dataclass(frozen=True)
class PlanParam:
    name: str
    shape: tuple[int, ...]
    dtype: str
    bytes: int
    static_bytes: int  # weights + gradients + optimizer state
    trainable: bool
    aliases: tuple[str, ...]
    stages: tuple[int, ...]  # (owner,): the one stage holding it; () when nothing reads it
    frozen: bool = False  # a weight of the model that does not train (not a buffer)


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
        """Peak bytes on a GPU; micro-batches in flight (and, split, between B and W) per stage
        from the schedule unless given."""
        by_name = {p.name: p for p in self.params}
        parts = []
        for s in self.stages_on(gpu):
            policy = self.policies[s.id]
            if in_flight:
                policy = replace(policy, in_flight=in_flight[s.id])
            if deferred:
                policy = replace(policy, deferred=deferred[s.id])
            owned = [by_name[n] for n in s.params]
            parts.append(
                stage_memory(
                    trainable_bytes=sum(p.bytes for p in owned if p.trainable),
                    frozen_bytes=sum(p.bytes for p in owned if not p.trainable),
                    state_bytes=sum(p.static_bytes - p.bytes for p in owned),
                    input_bytes=0 if s.forward_only else s.input_bytes,
                    act_bytes=s.act_bytes,
                    policy=policy,
                )
            )
        return gpu_memory_bytes(parts)

    @property
    def max_memory_bytes(self) -> int:
        return max(self.gpu_memory(g) for g in range(self.gpus))

    @property
    def feasible(self) -> bool:
        return self.max_memory_bytes <= self.memory_bytes

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
        without memory."""
        from ftpipe_runtime.schedules import SCHEDULES

        if self.schedule not in SCHEDULES:
            raise unknown("schedule", self.schedule, SCHEDULES)
        if self.gpus < 1 or self.micro_batches < 1 or self.bandwidth <= 0:
            raise FtpipeError("gpus and micro_batches must be at least 1 and bandwidth positive")
        if [s.id for s in self.stages] != list(range(len(self.stages))) or not self.stages:
            raise FtpipeError("stages must be numbered 0, 1, 2, ... in order")
        if not 0 <= self.loss_stage < len(self.stages):
            raise FtpipeError(f"the loss stage {self.loss_stage} is not a stage of the plan")
        seen: set[str] = set()
        for s in self.stages:
            dup = seen.intersection(s.nodes)
            if dup:
                raise FtpipeError(f"nodes {sorted(dup)[:3]} are in two stages")
            seen.update(s.nodes)
            if not 0 <= s.gpu < self.gpus:
                raise FtpipeError(f"stage {s.id} is on GPU {s.gpu}, outside 0..{self.gpus - 1}")
            if not all(math.isfinite(x) and x >= 0 for x in (s.fwd_s, s.bwd_s, s.recompute_s)):
                raise FtpipeError(f"stage {s.id} has a negative or non-finite time")
            if not 0 <= s.wgrad_s <= s.bwd_s * (1 + 1e-9):
                raise FtpipeError(
                    f"stage {s.id}: its weight-gradient time {s.wgrad_s} is not part of its "
                    f"backward time {s.bwd_s}"
                )
        g = nx.DiGraph()
        g.add_nodes_from(s.id for s in self.stages)
        for t in self.transfers:
            if not {t.producer, *t.consumers} <= set(g):
                raise FtpipeError(f"transfer {t.tensor} names a stage the plan does not have")
            for c in t.consumers:
                if c <= t.producer:
                    raise FtpipeError(f"stage {c} receives from a later stage {t.producer}")
                g.add_edge(t.producer, c)
        if any(not set(p.stages) <= set(g) for p in self.params):
            raise FtpipeError("a parameter is owned by a stage the plan does not have")
        if not nx.is_directed_acyclic_graph(g):
            raise FtpipeError("the stage graph has a cycle")
        for gpu in range(self.gpus):
            ids = [s.id for s in self.stages_on(gpu)]
            if ids != sorted(ids):
                raise FtpipeError(f"stages on GPU {gpu} are not in topological order")
        try:
            resolve_schedule(self.schedule, self.recompute).check(
                self.stage_infos(), self.micro_batches
            )
        except ScheduleError as e:
            raise FtpipeError(str(e)) from None
        self._validate_placement()
        if not memory:
            return
        over = [g for g in range(self.gpus) if self.gpu_memory(g) > self.memory_bytes]
        if over:
            raise FtpipeError(
                f"GPU {over[0]} needs {self.gpu_memory(over[0]) / 2**30:.1f} GiB, more than its "
                f"{self.memory_bytes / 2**30:.1f} GiB"
            )

    def _validate_placement(self) -> None:
        if self.replicas < 1:
            raise FtpipeError(f"a plan needs at least 1 replica, not {self.replicas}")
        want = sorted((r, g) for r in range(self.replicas) for g in range(self.gpus))
        if sorted(self.placed()) != want:
            raise FtpipeError(
                f"the placement must give each of the {self.replicas} replicas' {self.gpus} GPUs "
                "one rank"
            )
        if self.cluster is not None and self.cluster.gpus != self.world:
            raise FtpipeError(
                f"the plan runs on {self.world} GPUs but its cluster has {self.cluster.gpus}"
            )

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
        nested = ("stages", "transfers", "params", "cluster")
        flat = [f.name for f in fields(cls) if f.name not in nested]
        try:
            plan = _typed(
                cls,
                {k: d[k] for k in flat if k in d}
                | {
                    "stages": tuple(_typed(Stage, s) for s in d["stages"]),
                    "transfers": tuple(_typed(Transfer, t) for t in d["transfers"]),
                    "params": tuple(_typed(PlanParam, p) for p in d["params"]),
                    "cluster": Cluster.from_json(d["cluster"]) if d.get("cluster") else None,
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
        """Read and check a plan file (structure, not memory: `simulate` shows what overflows)."""
        plan = cls.from_json(read_json(path, "plan"))
        try:
            plan.validate(memory=False)
        except FtpipeError as e:
            raise PlanFormatError(f"{path} is not a valid plan: {e}") from None
        return plan

    def with_(self, **changes) -> Plan:
        return replace(self, **changes)
