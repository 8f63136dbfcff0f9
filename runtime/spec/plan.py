"""plan.json as typed data: the contract between the compiler, the runtime and generated code.

    plan = read_plan("out/t5_tiny_pipeline/plan.json")   # spec/reader.py: read and checked once
    plan.stages[0].inputs; plan.transfers[0].consumers; plan.params[0].aliases
    Plan.from_dict(d) / plan.to_dict()                    # the JSON object, versioned

A plan says which stage runs which graph nodes, which GPU runs each stage, what crosses
between stages (`transfers`: activations, and the weights an owner sends to the other stages
reading them) and every figure the simulator needs (seconds, bytes). The compiler's `Plan`
(ftpipe_compiler.plan) is this class with the figures computed from them and its cost
model's records for `cluster` and `reserve`; the runtime reads this one. The file a package
runs and the one `ftpipe compile` writes beside it are the same bytes.
"""

from __future__ import annotations

from dataclasses import MISSING, dataclass, field, fields

from ..errors import PipelineConfigError
from ..schedules import StageInfo, with_chunks
from .records import from_json, to_json

__all__ = [
    "PLAN_FORMAT",
    "PLAN_KIND",
    "READABLE_FORMATS",
    "Plan",
    "PlanParam",
    "Stage",
    "Transfer",
    "kept_forward_s",
    "step_work_s",
]

# Bumped whenever plan.json changes shape; the compiler and the runtime refuse other formats.
# Format 2 added data parallelism (replicas, placement, cluster); a format-1 plan is one
# pipeline, read as such.
PLAN_FORMAT = 2
READABLE_FORMATS = (1, 2)
PLAN_KIND = "ftpipe-plan"


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
    tensor: str  # the value's name (a traced value, a graph node) or a parameter's (its owner sends it)
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
    version: str = ""  # of the ftpipe that wrote it
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
        per_node = (self.cluster or {}).get("gpus_per_node")
        return int(per_node) if per_node else self.world

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

    # --- JSON ---
    def to_dict(self) -> dict:
        return {"format": PLAN_FORMAT, "kind": PLAN_KIND, **to_json(self)}

    @classmethod
    def from_dict(cls, d) -> Plan:
        """The plan of a JSON object, or one sentence (PipelineConfigError) saying why not:
        not a plan, another format, a missing or mistyped field."""
        if not isinstance(d, dict) or d.get("kind") != PLAN_KIND:
            raise PipelineConfigError(
                "this file is not an ftpipe plan; make one with `ftpipe compile`"
            )
        if d.get("format") not in READABLE_FORMATS:
            raise PipelineConfigError(
                f"plan format {d.get('format')} was written by ftpipe {d.get('version', '?')}; "
                f"this ftpipe reads formats {' and '.join(map(str, READABLE_FORMATS))}: compile "
                "it again with this version"
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
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise PipelineConfigError(
                f"the plan file is incomplete or damaged ({type(e).__name__}: {e}); compile it "
                "again"
            ) from None
        copied = [p.name for p in plan.params if len(p.stages) > 1]
        if copied:
            raise PipelineConfigError(
                f"this plan copies {copied[0]} into several stages (ftpipe before weights were "
                "sent between stages); compile it again"
            )
        return plan
