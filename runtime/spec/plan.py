"""plan.json as typed data: the contract between the compiler, the runtime and generated code.

    plan = read_plan("out/t5_tiny_pipeline/plan.json")   # read and checked once; model folder found
    plan = Plan.read(path)                                # the same, the model's path as written
    plan.stages[0].inputs; plan.transfers[0].consumers; plan.params[0].aliases
    Plan.from_dict(d) / plan.to_dict()                    # the JSON object, versioned and checked

A plan says which stage runs which graph nodes, which GPU runs each stage, what crosses
between stages (`transfers`: activations, and the weights an owner sends to the other stages
reading them) and every figure the simulator needs (seconds, bytes). The compiler's `Plan`
(ftpipe_compiler.plan) is this class with the figures computed from them and its cost
model's records for `cluster`, `reserve` and `host`; the runtime reads this one. The file a
package runs and the one `ftpipe compile` writes beside it are the same bytes, and
`Plan.from_dict(d).to_dict() == d` for every plan ftpipe writes.

There is one reader, `Plan.read` (inherited by the compiler's `Plan`), and one set of
structural checks, `check_plan` (the format, every field's type, stages numbered 0..n-1 on
existing GPUs, transfers forwards between existing stages, the schedule placeable, ranks
placed): a plan that fails them fails in the same sentence in `ftpipe simulate`, in a
package's `python -m` and in the runtime. The compiler adds only what needs its cost model
(memory: `ftpipe_compiler.plan.checks`).
"""

from __future__ import annotations

import math
from dataclasses import MISSING, dataclass, field, fields, replace
from pathlib import Path

from ..errors import PipelineConfigError, ScheduleError, unknown_name
from ..schedules import SCHEDULES, StageInfo, resolve_schedule, with_chunks
from .format import PLAN_FORMAT, READABLE_FORMATS
from .records import from_json, to_json
from .topology import read_json

__all__ = [
    "PLAN_FORMAT",
    "PLAN_KIND",
    "READABLE_FORMATS",
    "GRADIENT_SUMS",
    "OFFLOAD_STEPS",
    "Offload",
    "Plan",
    "PlanParam",
    "Stage",
    "Transfer",
    "check_plan",
    "kept_forward_s",
    "read_plan",
    "step_work_s",
]

PLAN_KIND = "ftpipe-plan"
REMEDY = "compile it again with `ftpipe compile`"


def kept_forward_s(fwd_s: float, recompute_s: float) -> float:
    """The forward of work that keeps its autograd graph: run once, recording (recompute_s;
    0 where nothing in it needs redoing before a backward, which then records nothing: its
    forward, fwd_s, timed without gradients)."""
    return max(fwd_s, recompute_s)


def step_work_s(fwd_s: float, bwd_s: float, recompute_s: float, recompute: bool) -> float:
    """Seconds of compute per micro-batch: a recomputing stage runs its forward without
    gradients, then again recording before its backward; a keeping one runs it once,
    recording."""
    return bwd_s + (fwd_s + recompute_s if recompute else kept_forward_s(fwd_s, recompute_s))


@dataclass(frozen=True)
class Offload:
    """What one stage keeps in host memory instead of on its GPU (the planner's choice,
    the compiler's `planner/offload.py`; its costs: `costs/host.py`)."""

    optimizer: bool = False  # fp32 masters, optimizer state, summed gradients; the CPU steps
    activations: bool = False  # what it keeps for its backward, fetched back one ahead
    # With `optimizer`: where its micro-batches' gradients are summed (`GRADIENT_SUMS`).
    gradients: str = "host"
    # With `optimizer`: where its CPU step's new weights land (`OFFLOAD_STEPS`).
    step: str = "exact"

    @property
    def any(self) -> bool:
        return self.optimizer or self.activations

    @property
    def lagged(self) -> bool:
        """Its optimizer offloaded, each step's new weights landing at its next step."""
        return self.optimizer and self.step == "lagged"

    @property
    def sums_on_device(self) -> bool:
        """Its optimizer offloaded, its gradients summed on the GPU and sent once a step."""
        return self.optimizer and self.gradients == "device"

    def words(self) -> str:
        """'optimizer state and activations', 'optimizer state', 'activations' or 'nothing'."""
        parts = ["optimizer state"] * self.optimizer + ["activations"] * self.activations
        return " and ".join(parts) or "nothing"


# Where an offloaded optimizer's gradients are summed over a step's micro-batches
# (`ftpipe_runtime.train.offload`; chosen per stage by the compiler's planner/offload.py).
GRADIENT_SUMS = {
    "host": "each micro-batch's gradient copied to the host as it is made, summed there",
    "device": "summed on the GPU in fp32 (4 bytes an element), copied to the host once a step",
}

# Where an offloaded stage's CPU step lands (`ftpipe_runtime.train.offload`): both run the
# step beside the rank's next actions; `lagged` only under a schedule whose actions read the
# weights as they are (FTPipe's asynchronous one), elsewhere it is `exact`.
OFFLOAD_STEPS = {
    "exact": "where the stage's weights are next read: the update of the run without offload",
    "lagged": "at the stage's next step: its actions meanwhile read the weights one step "
    "older (FTPipe's rule one step more stale), so the whole CPU step overlaps them",
}


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
    inputs: tuple[str, ...]  # transfers received (their `tensor` names)
    outputs: tuple[str, ...]  # transfers sent (values it computes, or parameters it owns)
    model_inputs: tuple[str, ...]  # model inputs read straight from the data
    input_bytes: int  # per micro-batch: transfers received + model inputs
    act_bytes: int  # per micro-batch: activations kept for backward without recompute
    wgrad_s: float = 0.0  # the part of bwd_s a split backward's W runs (weight gradients)
    # Nodes of other stages it recomputes instead of receiving their outputs (the compiler's
    # partition/remat; their costs are in the figures above), in graph order.
    copies: tuple[str, ...] = ()
    # Nothing trainable in it or before it: no backward, nothing kept (stage/frozen.py).
    forward_only: bool = False
    # Its optimizer step (the cost model's, for the parameters it owns; 0: free).
    step_s: float = 0.0
    # What it keeps in host memory instead of on its GPU: {"optimizer": bool, "activations": bool}.
    offload: Offload = Offload()
    # Its fp32 masters and optimizer state sharded across the plan's replicas (ZeRO-1,
    # train/zero.py; the compiler's planner/offload.py chooses it, never with
    # `offload.optimizer`); --shard-optimizer / --no-shard-optimizer override it.
    shard_optimizer: bool = False
    # Weights (its own or received) its nodes read more than once (T5's decoder embeds and
    # predicts with one): its backward holds two of their gradients before adding them.
    reread: tuple[str, ...] = ()

    def sharded_over(self, replicas: int) -> int:
        """Replicas its masters and optimizer state are cut among (1: whole on each)."""
        return replicas if self.shard_optimizer and replicas > 1 else 1

    @property
    def compute_s(self) -> float:
        return self.work_s(self.recompute)

    def work_s(self, recompute: bool) -> float:
        """Compute seconds per micro-batch, recomputing or keeping its graph."""
        return step_work_s(self.fwd_s, self.bwd_s, self.recompute_s, recompute)

    def forward_s(self, recompute: bool) -> float:
        """Its F: without gradients when it recomputes later, else recording its graph."""
        return self.fwd_s if recompute else kept_forward_s(self.fwd_s, self.recompute_s)


@dataclass(frozen=True)
class Transfer:
    tensor: (
        str  # the value's name (a traced value, a graph node) or a parameter's (its owner sends it)
    )
    producer: int  # stage
    consumers: tuple[int, ...]  # stages
    shape: tuple[int, ...]
    dtype: str  # a torch dtype's name: "float32", "int64"
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
    # Where the plan came from, for the reader, the code generator and the runtime's data:
    # spec, task, micro_batch, inputs ({name: [shape, dtype]}), head, compute_dtype, path...
    model: dict = field(default_factory=dict)
    competitors: tuple[dict, ...] = ()
    simulated: dict = field(default_factory=dict)
    command: str = ""
    recompute: bool = True  # False: every stage keeps its activations (the planner's choice)
    # Data parallelism: `replicas` copies of the pipeline; rank r of the job runs GPU
    # placement[r][1] of replica placement[r][0] (() : one replica, rank = GPU).
    replicas: int = 1
    placement: tuple[tuple[int, int], ...] = ()
    cluster: dict | None = None  # the nodes and links the plan was made for (JSON object)
    # Per micro-batch: bytes (activations and their gradients) that stages' `copies` keep
    # from crossing between GPUs; the weights the copies read travel instead.
    remat_saved_bytes: int = 0
    latency_s: float = 0.0  # the machine's point-to-point message cost beside `bandwidth`
    reserve: dict = field(default_factory=dict)  # what each GPU holds besides the run's tensors
    host: dict = field(default_factory=dict)  # the host memory, link and CPUs offloading uses
    version: str = ""  # of the ftpipe that wrote it
    # The compiler's figures of it (period, speed-up, memory; computed when it writes one),
    # for people and tools reading the file; not part of what the plan is.
    summary: dict = field(default_factory=dict, compare=False)
    # A package's plan: the command that generated it, and the graph node (or parameter)
    # behind each transfer (its `tensor` is then the traced value's name).
    generated_by: str = ""
    wires: dict = field(default_factory=dict)

    # --- where the ranks are ---
    @property
    def world(self) -> int:
        """Processes the plan runs on: every GPU of every replica."""
        return self.replicas * self.gpus

    def placed(self) -> tuple[tuple[int, int], ...]:
        """(replica, GPU of the pipeline) of every rank."""
        return self.placement or tuple((0, g) for g in range(self.gpus))

    @property
    def gpus_per_node(self) -> int:
        """GPUs of one machine of the cluster the plan was made for (all of them: one machine)."""
        per_node = self._cluster_says("gpus_per_node")
        return int(per_node) if per_node else self.world

    def _cluster_says(self, name: str):
        """A figure of `cluster`: a JSON object here, the compiler's `Cluster` there."""
        c = self.cluster
        return c.get(name) if isinstance(c, dict) else getattr(c, name, None)

    def stages_on(self, gpu: int) -> list[Stage]:
        return [s for s in self.stages if s.gpu == gpu]

    def stage_infos(self) -> list[StageInfo]:
        """The stages as a schedule sees them (GPU, depth, loss, chunk)."""
        return with_chunks(
            StageInfo(s.id, s.gpu, s.depth, s.id == self.loss_stage) for s in self.stages
        )

    # --- what the model's record says ---
    @property
    def compute_dtype(self) -> str:
        """The dtype the stages were traced to compute in ("float32", "bfloat16"...)."""
        return str(self.model.get("compute_dtype", "float32"))

    @property
    def micro_batch(self) -> int:
        """Samples per micro-batch: the first dimension of the model's inputs."""
        inputs = self.model.get("inputs") or {}
        return int(next(iter(inputs.values()))[0][0]) if inputs else 1

    def with_model_folder(self, plan_path) -> Plan:
        """The plan with its model's folder found on this machine (`spec.weights.model_folder`:
        --weights / $FTPIPE_WEIGHTS, else the recorded path relative to the plan's folder)."""
        from .weights import model_folder  # torch: only where a package runs

        if self.model.get("path") is None:
            return self
        found = model_folder(self.model["path"], Path(plan_path).parent)
        return replace(self, model={**self.model, "path": found})

    # --- JSON ---
    # What a damaged file's parts raise while they are built (a subclass adds its records').
    DAMAGED = (KeyError, TypeError, ValueError, AttributeError)

    def to_dict(self) -> dict:
        return {"format": PLAN_FORMAT, "kind": PLAN_KIND, **to_json(self)}

    @classmethod
    def from_dict(cls, d) -> Plan:
        """The plan of a JSON object, checked (`check_plan`), or one sentence
        (PipelineConfigError) saying why not: not a plan, another format, a missing or
        mistyped field, stages or transfers that do not fit together."""
        if not isinstance(d, dict) or d.get("kind") != PLAN_KIND:
            raise PipelineConfigError(
                "this file is not an ftpipe plan; make one with `ftpipe compile`"
            )
        if d.get("format") not in READABLE_FORMATS:
            raise PipelineConfigError(
                f"plan format {d.get('format')} was written by ftpipe {d.get('version', '?')}; "
                f"this ftpipe reads formats {' and '.join(map(str, READABLE_FORMATS))}: "
                f"{REMEDY} of this version"
            )
        missing = [
            f.name
            for f in fields(cls)
            if f.default is MISSING and f.default_factory is MISSING and f.name not in d
        ]
        try:
            if missing:
                raise KeyError(missing[0])
            plan = from_json(cls, d)
        except cls.DAMAGED as e:
            raise PipelineConfigError(
                f"the plan file is incomplete or damaged ({type(e).__name__}: {e}); {REMEDY}"
            ) from None
        check_plan(plan)
        return plan

    @classmethod
    def read(cls, path) -> Plan:
        """THE plan reader: the file at `path`, checked, or a PipelineConfigError naming it
        and saying what is wrong (the compiler's `Plan.load` and the runtime's `read_plan`
        both come here)."""
        d = read_json(path, "the plan", REMEDY)
        try:
            return cls.from_dict(d)
        except PipelineConfigError as e:  # the compiler's PlanFormatError is one too
            raise type(e)(f"{path} is not a valid plan: {e}") from None


def read_plan(path) -> Plan:
    """The plan file a package runs, checked, its model's folder found on this machine."""
    return Plan.read(path).with_model_folder(path)


def check_plan(plan: Plan, *, runnable: bool = True) -> None:
    """What every reader of a plan relies on, in the order a reader would look: its sizes,
    its stages, what crosses between them, the schedule, where the ranks go; `runnable`,
    also every GPU given a stage (what a plan file must be: a rank with nothing to run
    would wait forever; a plan the compiler is still cutting may leave some idle until it
    compacts it). Raises PipelineConfigError naming the first thing wrong. (Memory needs
    the compiler's cost model: `ftpipe_compiler.plan.checks`.)"""
    for check in (_check_sizes, _check_stages, _check_transfers, _check_schedule):
        check(plan)
    if runnable:
        _check_no_idle_gpu(plan)
    _check_placement(plan)


def _check_sizes(plan: Plan) -> None:
    if plan.gpus < 1 or plan.micro_batches < 1 or plan.bandwidth <= 0:
        raise PipelineConfigError(
            "gpus and micro_batches must be at least 1 and bandwidth positive"
        )
    if not plan.stages or [s.id for s in plan.stages] != list(range(len(plan.stages))):
        raise PipelineConfigError("stages must be numbered 0, 1, 2, ... in order")
    if not 0 <= plan.loss_stage < len(plan.stages):
        raise PipelineConfigError(f"the loss stage {plan.loss_stage} is not a stage of the plan")
    copied = [p.name for p in plan.params if len(p.stages) > 1]
    if copied:
        raise PipelineConfigError(
            f"this plan copies {copied[0]} into several stages (ftpipe before weights were "
            f"sent between stages); {REMEDY}"
        )


def _check_stages(plan: Plan) -> None:
    seen: set[str] = set()
    listed = {p.name for p in plan.params}  # (a hand-written plan may list none)
    for s in plan.stages:
        unknown = [n for n in (*s.params, *s.reread) if listed and n not in listed]
        if unknown:
            raise PipelineConfigError(
                f"stage {s.id} names the parameter {unknown[0]!r:.80}, which the plan's params "
                "do not list; the plan file was edited or damaged: compile it again"
            )
        dup = seen.intersection(s.nodes)
        if dup:
            raise PipelineConfigError(f"nodes {sorted(dup)[:3]} are in two stages")
        seen.update(s.nodes)
        if not 0 <= s.gpu < plan.gpus:
            raise PipelineConfigError(f"stage {s.id} is on GPU {s.gpu}, outside 0..{plan.gpus - 1}")
        if not all(math.isfinite(x) and x >= 0 for x in (s.fwd_s, s.bwd_s, s.recompute_s)):
            raise PipelineConfigError(f"stage {s.id} has a negative or non-finite time")
        if not 0 <= s.wgrad_s <= s.bwd_s * (1 + 1e-9):
            raise PipelineConfigError(
                f"stage {s.id}: its weight-gradient time {s.wgrad_s} is not part of its "
                f"backward time {s.bwd_s}"
            )
        if s.offload.gradients not in GRADIENT_SUMS:
            raise PipelineConfigError(
                f"stage {s.id} sums its offloaded gradients on {s.offload.gradients!r:.40}, "
                f"not one of {', '.join(GRADIENT_SUMS)}; compile the plan again"
            )
        if s.offload.step not in OFFLOAD_STEPS:
            raise PipelineConfigError(
                f"stage {s.id} lands its offloaded step {s.offload.step!r:.40}, not one of "
                f"{', '.join(OFFLOAD_STEPS)}; compile the plan again"
            )
        if s.shard_optimizer and s.offload.optimizer:  # the runtime runs one or the other
            raise PipelineConfigError(
                f"stage {s.id} both offloads its optimizer state to the host and shards it "
                "across replicas; compile the plan again"
            )


def _check_transfers(plan: Plan) -> None:
    """Transfers and parameters between existing stages, forwards only (so the stage graph
    has no cycle, and each GPU's stages, in id order, are in a topological order); every
    input of a stage sent by somebody."""
    ids = {s.id for s in plan.stages}
    sent = set()
    for t in plan.transfers:
        if not {t.producer, *t.consumers} <= ids:
            raise PipelineConfigError(f"transfer {t.tensor} names a stage the plan does not have")
        for c in t.consumers:
            if c <= t.producer:
                raise PipelineConfigError(
                    f"stage {c} receives {t.tensor} from a later stage {t.producer}"
                )
        sent.add(t.tensor)
    if any(not set(p.stages) <= ids for p in plan.params):
        raise PipelineConfigError("a parameter is owned by a stage the plan does not have")
    for s in plan.stages:
        missing = [n for n in s.inputs if n not in sent]
        if missing:
            raise PipelineConfigError(f"stage {s.id} receives {missing[0]!r}, which nobody sends")


def _check_schedule(plan: Plan) -> None:
    if plan.schedule not in SCHEDULES:
        raise PipelineConfigError(unknown_name("schedule", plan.schedule, SCHEDULES))
    try:
        resolve_schedule(plan.schedule, plan.recompute).check(
            plan.stage_infos(), plan.micro_batches
        )
    except ScheduleError as e:
        raise PipelineConfigError(str(e)) from None


def _check_no_idle_gpu(plan: Plan) -> None:
    idle = sorted(set(range(plan.gpus)) - {s.gpu for s in plan.stages})
    if idle:
        raise PipelineConfigError(
            f"the plan gives GPU {idle[0]} no stage ({len(idle)} of {plan.gpus} GPUs idle); "
            f"{REMEDY}: the compiler keeps plans on the GPUs they use"
        )


def _check_placement(plan: Plan) -> None:
    if plan.replicas < 1:
        raise PipelineConfigError(f"a plan needs at least 1 replica, not {plan.replicas}")
    want = sorted((r, g) for r in range(plan.replicas) for g in range(plan.gpus))
    if sorted(plan.placed()) != want:
        raise PipelineConfigError(
            f"the placement must give each of the {plan.replicas} replicas' {plan.gpus} GPUs "
            "one rank"
        )
    cluster_gpus = plan._cluster_says("gpus")
    if plan.cluster is not None and cluster_gpus != plan.world:
        raise PipelineConfigError(
            f"the plan runs on {plan.world} GPUs but its cluster has {cluster_gpus}"
        )
