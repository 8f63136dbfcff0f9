"""Who runs where: the plan's stages, transfers and tied parameters, seen from any rank.

    topo = Topology(plan)           # plan: the plan.json dict
    topo.stages_on(rank)            # [0, 2]
    topo.remote_ranks("add_7")      # ranks other than the producer's that consume it
    topo.clusters                   # stages whose optimizer steps are coupled by tied weights

Pure bookkeeping over the plan dict: every rank builds the same Topology, so decisions
taken from it (message order, process groups, step points) agree across ranks.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .errors import PipelineConfigError


@dataclass(frozen=True)
class TransferInfo:
    name: str
    producer: int
    consumers: tuple[int, ...]
    shape: tuple[int, ...]
    dtype: torch.dtype
    grad: bool  # a gradient flows back: requires_grad and a floating-point tensor


@dataclass(frozen=True)
class TiedParam:
    name: str
    stages: tuple[int, ...]  # every stage holding a copy
    ranks: tuple[int, ...]  # the ranks of those stages: its gradient is summed across them


class Topology:
    def __init__(self, plan: dict):
        try:
            self.world = int(plan["gpus"])
            self.loss_stage = int(plan["loss_stage"])
            stages = sorted(plan["stages"], key=lambda s: s["id"])
            self.rank_of = {s["id"]: int(s["gpu"]) for s in stages}
            self.depth = {s["id"]: int(s.get("depth", 0)) for s in stages}
            self.inputs = {s["id"]: tuple(s["inputs"]) for s in stages}
            self.outputs = {s["id"]: tuple(s["outputs"]) for s in stages}
            self.model_inputs = {s["id"]: tuple(s["model_inputs"]) for s in stages}
            self.transfers = {t["tensor"]: _transfer(t) for t in plan["transfers"]}
            tied = [p for p in plan["params"] if p.get("trainable", True) and len(p["stages"]) > 1]
        except (KeyError, TypeError) as e:
            raise PipelineConfigError(f"the plan is incomplete ({e}); compile it again") from None
        self.stage_ids = tuple(self.rank_of)
        self.tied = {
            p["name"]: TiedParam(
                p["name"],
                tuple(sorted(p["stages"])),
                tuple(sorted({self.rank_of[s] for s in p["stages"]})),
            )
            for p in sorted(tied, key=lambda p: p["name"])
        }
        self.clusters = _clusters(self.stage_ids, [t.stages for t in self.tied.values()])
        self._check()

    def _check(self) -> None:
        bad = [r for r in self.rank_of.values() if not 0 <= r < self.world]
        if bad:
            raise PipelineConfigError(f"a stage is on GPU {bad[0]}, outside 0..{self.world - 1}")
        for t in self.transfers.values():
            if any(c <= t.producer for c in t.consumers):
                raise PipelineConfigError(f"transfer {t.name} goes to an earlier stage")
        if self.loss_stage not in self.rank_of:
            raise PipelineConfigError(f"the loss stage {self.loss_stage} is not in the plan")

    def stages_on(self, rank: int) -> list[int]:
        return [s for s in self.stage_ids if self.rank_of[s] == rank]

    def remote_ranks(self, name: str) -> list[int]:
        """Ranks that receive transfer `name`: one message each, however many stages read it."""
        t = self.transfers[name]
        src = self.rank_of[t.producer]
        return sorted({self.rank_of[c] for c in t.consumers} - {src})

    def local_consumers(self, name: str, rank: int) -> list[int]:
        return [c for c in self.transfers[name].consumers if self.rank_of[c] == rank]

    def cluster_of(self, stage: int) -> tuple[int, ...]:
        return next(c for c in self.clusters if stage in c)

    def tied_of(self, stages) -> list[TiedParam]:
        """Tied parameters held by any of `stages`, in the one order every rank uses."""
        want = set(stages)
        return [t for t in self.tied.values() if want.intersection(t.stages)]

    def owner(self, param: str) -> int:
        """The stage whose copy of a tied parameter counts in norms and checksums."""
        return self.tied[param].stages[0]


def _transfer(t: dict) -> TransferInfo:
    dtype = getattr(torch, str(t["dtype"]).removeprefix("torch."))
    return TransferInfo(
        name=t["tensor"],
        producer=int(t["producer"]),
        consumers=tuple(int(c) for c in t["consumers"]),
        shape=tuple(int(x) for x in t["shape"]),
        dtype=dtype,
        grad=bool(t.get("requires_grad", False)) and dtype.is_floating_point,
    )


def _clusters(stage_ids, groups) -> tuple[tuple[int, ...], ...]:
    """Connected components of stages linked by a shared tied parameter (singletons too)."""
    parent = {s: s for s in stage_ids}

    def root(x: int) -> int:
        while parent[x] != x:
            x = parent[x]
        return x

    for g in groups:
        for s in g[1:]:
            parent[root(s)] = root(g[0])
    out: dict[int, list[int]] = {}
    for s in stage_ids:
        out.setdefault(root(s), []).append(s)
    return tuple(tuple(sorted(c)) for c in sorted(out.values()))
