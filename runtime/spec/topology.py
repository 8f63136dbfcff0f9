"""Who runs where: the plan's stages and transfers, seen from any rank.

    topo = Topology(plan)           # plan: the plan.json dict
    topo.stages_on(rank)            # [0, 2]
    topo.remote_ranks("add_7")      # ranks other than the producer's that consume it
    topo.transfers["shared.weight"].weight   # a parameter its owner stage sends along
    topo.offload_optimizer          # stages the plan offloads the optimizer of: {1, 3}
    plan = read_plan("pkg/plan.json")   # the dict, or one sentence saying why it cannot be read

Pure bookkeeping over the plan dict: every rank builds the same Topology, so decisions
taken from it (message order, process groups, step points) agree across ranks. Every
parameter lives in one stage; other stages reading it receive it as a transfer named after
it, and their gradients flow back to the owner like any activation gradient.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from ..errors import PipelineConfigError
from ..schedules import StageGraph, StageInfo, with_chunks
from .format import PLAN_FORMAT, READABLE_FORMATS
from .weights import model_folder


def read_plan(path) -> dict:
    """The plan file a package runs, or a PipelineConfigError saying why it cannot be used
    (the compiler's `Plan.load` reads with `read_json` and checks with `Topology` too)."""
    plan = read_json(path, "the plan", "compile the package again")
    Topology(plan)  # the checks, now, before anything starts
    model = plan.get("model")
    if isinstance(model, dict) and model.get("path") is not None:
        model["path"] = model_folder(model["path"], Path(path).parent)
    return plan


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
    def __init__(self, plan: dict):
        if not isinstance(plan, dict) or plan.get("kind", "ftpipe-plan") != "ftpipe-plan":
            raise PipelineConfigError("this is not an ftpipe plan; compile the package again")
        if plan.get("format", PLAN_FORMAT) not in READABLE_FORMATS:
            raise PipelineConfigError(
                f"the plan has format {plan.get('format')!r} but this runtime runs formats "
                f"{' and '.join(map(str, READABLE_FORMATS))}; compile the package again with "
                "this ftpipe"
            )
        try:
            self.world = int(plan["gpus"])
            self.loss_stage = int(plan["loss_stage"])
            stages = sorted(plan["stages"], key=lambda s: s["id"])
            self.rank_of = {s["id"]: int(s["gpu"]) for s in stages}
            self.depth = {s["id"]: int(s.get("depth", 0)) for s in stages}
            self.inputs = {s["id"]: tuple(s["inputs"]) for s in stages}
            self.outputs = {s["id"]: tuple(s["outputs"]) for s in stages}
            self.model_inputs = {s["id"]: tuple(s["model_inputs"]) for s in stages}
            # What the planner chose to keep in host memory, per stage ({"optimizer": bool,
            # "activations": bool}; absent: nothing): the stages whose optimizer is offloaded.
            self.offload_optimizer = frozenset(
                s["id"] for s in stages if (s.get("offload") or {}).get("optimizer")
            )
            self.offload_activations = frozenset(
                s["id"] for s in stages if (s.get("offload") or {}).get("activations")
            )
            params = {p["name"] for p in plan["params"]}
            self.transfers = {t["tensor"]: _transfer(t, params) for t in plan["transfers"]}
            copied = [p["name"] for p in plan["params"] if len(p["stages"]) > 1]
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise PipelineConfigError(
                f"the plan is incomplete or damaged ({type(e).__name__}: {e}); compile it again"
            ) from None
        if copied:
            raise PipelineConfigError(
                f"the plan puts a copy of {copied[0]} in several stages; it was compiled by an "
                "older ftpipe: compile the package again"
            )
        self.stage_ids = tuple(self.rank_of)
        self._check()

    def _check(self) -> None:
        """What the runtime relies on; the compiler's `Plan.validate` checks the same and more."""
        if self.world < 1 or sorted(self.rank_of) != list(range(len(self.rank_of))):
            raise PipelineConfigError("the plan needs stages numbered 0, 1, ... on 1 or more GPUs")
        bad = [r for r in self.rank_of.values() if not 0 <= r < self.world]
        if bad:
            raise PipelineConfigError(f"a stage is on GPU {bad[0]}, outside 0..{self.world - 1}")
        idle = sorted(set(range(self.world)) - set(self.rank_of.values()))
        if idle:
            raise PipelineConfigError(
                f"the plan gives GPU {idle[0]} no stage ({len(idle)} of {self.world} GPUs idle); "
                "compile it again: the compiler keeps plans on the GPUs they use"
            )
        for t in self.transfers.values():
            if not {t.producer, *t.consumers} <= set(self.rank_of):
                raise PipelineConfigError(f"transfer {t.name} names a stage the plan lacks")
            if any(c <= t.producer for c in t.consumers):
                raise PipelineConfigError(f"transfer {t.name} goes to an earlier stage")
        for s, names in self.inputs.items():
            missing = [n for n in names if n not in self.transfers]
            if missing:
                raise PipelineConfigError(f"stage {s} receives {missing[0]!r}, which nobody sends")
        if self.loss_stage not in self.rank_of:
            raise PipelineConfigError(f"the loss stage {self.loss_stage} is not in the plan")

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


def _transfer(t: dict, params: set[str]) -> TransferInfo:
    dtype = getattr(torch, str(t["dtype"]).removeprefix("torch."))
    return TransferInfo(
        name=t["tensor"],
        producer=int(t["producer"]),
        consumers=tuple(int(c) for c in t["consumers"]),
        shape=tuple(int(x) for x in t["shape"]),
        dtype=dtype,
        grad=bool(t.get("requires_grad", False)) and dtype.is_floating_point,
        weight=t["tensor"] in params,
    )
