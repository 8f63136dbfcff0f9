"""The parts of a plan: its stages, what crosses between them, and its parameters (plain,
frozen data; `Plan` in plan.py holds them and computes the figures)."""

from __future__ import annotations

from dataclasses import dataclass

from ..costs.host import Offload
from ..graph.opgraph import kept_forward_s, step_work_s

__all__ = ["PlanParam", "Stage", "Transfer"]


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
    # Nothing trainable in it or before it: no backward, nothing kept (ftpipe_runtime.stage.frozen).
    forward_only: bool = False
    # Its optimizer step (formulas.optimizer_step_s of the parameters it owns; 0: free).
    step_s: float = 0.0
    # What it keeps in host memory instead of on its GPU (costs/host.py; the planner's
    # choice, `planner/offload.py`): plan.json's {"optimizer": bool, "activations": bool}.
    offload: Offload = Offload()

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
