"""Who runs where: the plan's stages and transfers, seen from any rank.

    topo = Topology(plan)           # plan: the typed Plan (spec/plan.py), or its JSON object
    topo.stages_on(rank)            # [0, 2]
    topo.remote_ranks("add_7")      # ranks other than the producer's that consume it
    topo.transfers["shared.weight"].weight   # a parameter its owner stage sends along
    topo.offload_optimizer          # stages the plan offloads the optimizer of: {1, 3}
    topo.sums_on_device             # of those, the ones whose gradients sum on the GPU: {3}
    topo.lagged                     # of those, the ones whose steps land a step late: {1}

Pure bookkeeping over a checked plan (its checks are the plan's: `spec.plan.check_plan`):
every rank builds the same Topology, so decisions taken from it (message order, process
groups, step points) agree across ranks. Every parameter lives in one stage; other stages
reading it receive it as a transfer named after it, and their gradients flow back to the
owner like any activation gradient. `read_json` is every JSON reader's wording for a file
that cannot be read.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from ..errors import PipelineConfigError
from ..schedules import StageGraph, StageInfo, with_chunks

if TYPE_CHECKING:  # plan.py reads files with read_json, below
    from .plan import Plan, Transfer

__all__ = ["Topology", "TransferInfo", "read_json"]


def read_json(path, what: str, remedy: str):
    """A JSON file's value, or a PipelineConfigError naming `what` it is ("the plan") and the
    `remedy`. Every JSON file ftpipe reads back (plans, traces, the compiler's graphs) goes
    through here, so a damaged one reads the same wherever it is met."""
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except FileNotFoundError:
        raise PipelineConfigError(f"{what} file {path} does not exist") from None
    except UnicodeDecodeError:
        raise PipelineConfigError(
            f"{what} file {path} is not text (a binary file?); {remedy}"
        ) from None
    except json.JSONDecodeError as e:
        raise PipelineConfigError(
            f"{what} file {path} is not valid JSON (damaged or edited? {e.msg} at line "
            f"{e.lineno}); {remedy}"
        ) from None
    except OSError as e:
        raise PipelineConfigError(f"cannot read {what} file {path}: {e.strerror}") from None


@dataclass(frozen=True)
class TransferInfo:
    name: str
    producer: int
    consumers: tuple[int, ...]
    shape: tuple[int, ...]
    dtype: torch.dtype
    grad: bool  # a gradient flows back: requires_grad and a floating-point tensor
    weight: bool = False  # a parameter of the producer (sent as a snapshot of its value)


class Topology:
    def __init__(self, plan: Plan | dict):
        from .plan import Plan

        if not isinstance(plan, Plan):
            plan = Plan.from_dict(plan)  # checked as any plan is
        self.world = plan.gpus
        self.loss_stage = plan.loss_stage
        self.rank_of = {s.id: s.gpu for s in plan.stages}
        self.depth = {s.id: s.depth for s in plan.stages}
        self.inputs = {s.id: s.inputs for s in plan.stages}
        self.outputs = {s.id: s.outputs for s in plan.stages}
        self.model_inputs = {s.id: s.model_inputs for s in plan.stages}
        # What the planner chose to keep in host memory, per stage.
        self.offload_optimizer = frozenset(s.id for s in plan.stages if s.offload.optimizer)
        self.offload_activations = frozenset(s.id for s in plan.stages if s.offload.activations)
        self.sums_on_device = frozenset(s.id for s in plan.stages if s.offload.sums_on_device)
        self.lagged = frozenset(s.id for s in plan.stages if s.offload.lagged)
        self.reread = frozenset(s.id for s in plan.stages if s.reread)  # a weight read twice
        params = {p.name for p in plan.params}
        self.transfers = {t.tensor: _transfer(t, params) for t in plan.transfers}
        self.stage_ids = tuple(self.rank_of)

    def stage_infos(self) -> list[StageInfo]:
        """What a schedule needs to know of every stage (GPU, depth, loss, chunk)."""
        return with_chunks(
            StageInfo(s, self.rank_of[s], self.depth[s], s == self.loss_stage)
            for s in self.stage_ids
        )

    def stage_graph(self) -> StageGraph:
        """The stages and who sends to whom, for `validate`."""
        consumers: dict[int, set[int]] = {s: set() for s in self.stage_ids}
        for t in self.transfers.values():
            consumers[t.producer].update(t.consumers)
        return StageGraph.of(self.stage_infos(), {s: tuple(c) for s, c in consumers.items()})

    def stages_on(self, rank: int) -> list[int]:
        return [s for s in self.stage_ids if self.rank_of[s] == rank]

    def remote_ranks(self, name: str) -> list[int]:
        """Ranks that receive transfer `name`: one message each, however many stages read it."""
        t = self.transfers[name]
        src = self.rank_of[t.producer]
        return sorted({self.rank_of[c] for c in t.consumers} - {src})

    def local_consumers(self, name: str, rank: int) -> list[int]:
        return [c for c in self.transfers[name].consumers if self.rank_of[c] == rank]


def _transfer(t: Transfer, params: set[str]) -> TransferInfo:
    dtype = getattr(torch, t.dtype.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise PipelineConfigError(
            f"transfer {t.tensor} has dtype {t.dtype!r}, not a torch dtype; compile it again "
            "with `ftpipe compile`"
        )
    return TransferInfo(
        name=t.tensor,
        producer=t.producer,
        consumers=t.consumers,
        shape=t.shape,
        dtype=dtype,
        grad=t.requires_grad and dtype.is_floating_point,
        weight=t.tensor in params,
    )
