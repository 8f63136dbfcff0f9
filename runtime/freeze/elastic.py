"""Elastic pipelining at run time (PipeTransformer §3.2-3.3): switch to a shorter pipeline.

    shrinks = Shrinks.beside("out/bert_pipeline/plan.json")   # None: no elastic/ folder
    end = segment_end(first, steps, decides, shrinks.pending(gpus))
    ... the run trains steps first..end-1 on its plan ...
    nxt = shrinks.after(frozen, gpus, replicas, m)             # a shorter pipeline, or None
    plan, stages = shrinks.load(nxt)                           # and the run goes on on it
    tensors, state, received = hand_over(modules, optimizers, mixed, plan, place)  # every rank
    load_carried(carried, new_modules, new_optimizers, new_mixed)  # into the next plan's stages

`ftpipe compile --freeze-training ALPHA` writes, beside the package's plan, the plans of
the pipelines it may shrink to (`elastic/index.json`; `elastic/<name>/` holds each one's
plan.json and stages): the same model on GPUS/2, GPUS/4 ... GPUs of a pipeline with 2, 4 ...
times the replicas on the same ranks, each to be used once at least `frozen_layers`
layers are frozen. A run with freeze training (`--freeze-alpha`, `--freeze-at`) is cut
into segments that end at its freeze decisions while a shorter pipeline is left; after
a decision that froze enough, the weights and optimizer state move to the ranks the new
plan puts their stages on, by parameter name, and the run goes on from the next step on
the new plan: its stages are built on those ranks, freeze the same layers, load what they
were handed, and new process groups are made for the new pipelines and replicas; each
replica then reads its share of every step's micro-batches (the micro-batches per replica
shrink as the replicas grow, so a step trains on the same samples). Segment boundaries
are step boundaries of a synchronous schedule, so nothing is in flight when the run
switches.

The hand-over (`hand_over`) moves only what each rank's new stages need (the new plan's
`stages[i].params`, the names of their state dicts), point to point: every rank says what
it holds (names, shapes, dtypes: small objects, gathered), a rank that holds a name keeps
its own (replicas hold the very same weights and state), and the others receive it from the
first replica's holder, each tensor sent from the device it lives on into a buffer on the
receiver's (`torch.distributed` send/recv; under NCCL GPU to GPU). Scalar state (AdamW's
`step`) goes with the names, and the optimizer's own `load_state_dict` puts every state
tensor where it keeps it: on the parameter's device, `step` too for fused or capturable
AdamW, on the host otherwise. `received`: the bytes each rank received (the summary's
segment row says them).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from ..errors import PeerFailure, PipelineConfigError
from ..job import liveness
from ..job.ranks import all_gather
from ..spec.plan import read_plan
from ..stage.package import import_package
from ..train.replicas import Replicas

__all__ = ["Carried", "Shrinks", "hand_over", "load_carried", "segment_end"]


@dataclass(frozen=True)
class Shrink:
    name: str
    gpus: int
    replicas: int
    micro_batches: int
    frozen_layers: int


class Shrinks:
    """The shorter pipelines a package's run may switch to (`elastic/index.json`)."""

    def __init__(self, folder: Path, entries: list[Shrink]):
        self.folder, self.entries = folder, entries

    @classmethod
    def beside(cls, plan_path) -> Shrinks | None:
        folder = Path(plan_path).parent / "elastic"
        index = folder / "index.json"
        if not index.is_file():
            return None
        try:
            entries = [Shrink(**e) for e in json.loads(index.read_text())["plans"]]
        except (ValueError, KeyError, TypeError) as e:
            raise PipelineConfigError(
                f"{index} is damaged ({e}); compile the package again"
            ) from None
        return cls(folder, entries)

    def pending(self, gpus: int) -> bool:
        """Is there a shorter pipeline than one of `gpus` GPUs left?"""
        return any(e.gpus < gpus for e in self.entries)

    def after(self, frozen: int, gpus: int, replicas: int, m: int) -> Shrink | None:
        """The shortest pipeline that `frozen` layers allow, if shorter than the current
        one and its replicas can share the current step's m x replicas micro-batches."""
        fits = [
            e
            for e in self.entries
            if e.gpus < gpus and e.frozen_layers <= frozen and (m * replicas) % e.replicas == 0
        ]
        return min(fits, key=lambda e: e.gpus, default=None)

    def load(self, entry: Shrink) -> tuple[dict, dict]:
        """(its plan, its stage classes by stage number), imported from its folder."""
        where = self.folder / entry.name
        plan = read_plan(where / "plan.json").to_dict()  # as the run's modules read it
        return plan, import_package(where, "_ftpipe_elastic").STAGES


def segment_end(first: int, steps: int, decides: Callable[[int], bool], pending: bool) -> int:
    """The step the segment starting at `first` ends at: after the next freeze decision
    while a shorter pipeline is left, else the run's end."""
    if pending:
        for k in range(first, steps):
            if decides(k):
                return k + 1
    return steps


@dataclass
class Carried:
    """What a run hands from one plan to the next."""

    first: int  # the step the next segment starts at
    start: int  # the run's first step
    name: str  # of the plan switched to
    plan: dict
    stages: dict
    micro_batches: int
    frozen: int
    tensors: dict  # name -> weight, buffers included, of this rank's new stages
    optimizer: dict  # parameter name -> its optimizer state (this rank's new stages')
    losses: dict
    runlog: object = None
    segments: list = field(default_factory=list)


def hand_over(modules, optimizers, mixed, plan: dict, place) -> tuple[dict, dict, list[int]]:
    """(the weights, buffers included, and the optimizer state, by name, of this rank's
    stages in `plan`; the bytes each rank received), moved point to point (module doc).
    Every rank calls it with what it trained so far: its stages, their optimizers, `mixed`
    (precision.MixedPrecision) and its `place` (ranks.Place) in the plan ending."""
    mine, state = _holdings(modules, optimizers, mixed)
    held = {}  # name -> (the weight's spec, its optimizer state's): what this rank holds
    for n, t in mine.items():
        held[n] = (_spec(t), {k: _spec(v) for k, v in state.get(n, {}).items()})
    everyone = all_gather((place.replica, held), place.world, "handing over the weights")
    source: dict[str, int] = {}  # name -> the first replica's rank holding it
    for r, (replica, names) in enumerate(everyone):
        if replica == 0:
            for n in names:
                source.setdefault(n, r)
    tensors, opt, ops, inbound = {}, {}, [], []
    me = place.rank
    for dst, names in enumerate(_needs(plan)):  # the same order on every rank: sends and
        for n in names:  # receives of each pair of ranks meet in the order they are posted
            if n in everyone[dst][1]:  # its own (every replica's is the same)
                if dst == me:
                    tensors[n] = mine[n]
                    if n in state:
                        opt[n] = state[n]
                continue
            src = source.get(n)
            if src is None or me not in (src, dst):  # (missing: load_carried names it)
                continue
            weight, extra = everyone[src][1][n]
            parts = [(None, weight), *sorted(extra.items())]
            if me == src:
                for key, spec in parts:
                    if spec[0] == "tensor":
                        t = mine[n] if key is None else state[n][key]
                        ops.append(dist.P2POp(dist.isend, t.contiguous(), dst))
                continue
            got = {key: _receiving(spec, place.device, src, ops, inbound) for key, spec in parts}
            tensors[n] = got.pop(None)
            if got:
                opt[n] = got
    if ops:
        try:
            with liveness.waiting("handing over the weights"):
                for work in dist.batch_isend_irecv(ops):
                    work.wait()
        except PeerFailure:
            raise
        except Exception as e:  # noqa: BLE001
            raise liveness.failure("a rank vanished while handing over the weights", e) from e
    received = sum(t.numel() * t.element_size() for t in inbound)
    return tensors, opt, all_gather(received, place.world, "handing over the weights")


def _holdings(modules, optimizers, mixed) -> tuple[dict, dict]:
    """This rank's tensors by name (the fp32 masters of trained 16-bit weights) and the
    optimizer state of those it trains (the tensors themselves: nothing is copied)."""
    tensors, state = {}, {}
    for s, mod in modules.items():
        tensors.update(mixed.state_dict(s, mod))
        kept = optimizers[s].state if optimizers.get(s) is not None else {}
        for n, t in mixed.trainable(s):
            if t in kept:
                state[n] = kept[t]
    return tensors, state


def _needs(plan: dict) -> list[list[str]]:
    """Per rank of `plan`: the names of its stages' tensors (their state dicts' keys)."""
    names: dict[int, set] = {}
    for st in plan["stages"]:
        names.setdefault(int(st["gpu"]), set()).update(st["params"])
    return [sorted(names.get(gpu, ())) for _, gpu in Replicas.of(plan).placement]


def _spec(v) -> tuple:
    """How a value travels: ("tensor", shape, dtype) by itself; ("scalar", value, dtype)
    (a 0-d tensor: AdamW's step) and ("value", value) with the names."""
    if torch.is_tensor(v):
        dtype = str(v.dtype).removeprefix("torch.")
        return ("tensor", tuple(v.shape), dtype) if v.dim() else ("scalar", v.item(), dtype)
    return ("value", v)


def _receiving(spec: tuple, device, src: int, ops: list, inbound: list):
    """The value `spec` describes: a tensor receives into a buffer on `device` (posted
    in `ops`, kept in `inbound`); a scalar is made on the host, as optimizers make it."""
    kind = spec[0]
    if kind == "tensor":
        buf = torch.empty(spec[1], dtype=getattr(torch, spec[2]), device=device)
        ops.append(dist.P2POp(dist.irecv, buf, src))
        inbound.append(buf)
        return buf
    if kind == "scalar":
        return torch.tensor(spec[1], dtype=getattr(torch, spec[2]))
    return spec[1]


def load_carried(carried: Carried, modules, optimizers, mixed) -> None:
    """The handed-over weights and optimizer state into this rank's new stages (after the
    same layers were frozen in them); `carried` gives them up (they are the stages' now)."""
    for s, mod in modules.items():
        own = mod.state_dict()
        missing = sorted(set(own) - set(carried.tensors))
        if missing:
            raise PipelineConfigError(f"{missing[0]} was not handed over; compile again")
        mixed.load(s, mod, {k: carried.tensors[k] for k in own})
        if optimizers.get(s) is not None:
            _load_state(optimizers[s], mixed.trainable(s), carried.optimizer)
    carried.tensors.clear()
    carried.optimizer.clear()


def _load_state(opt, trainable, carried: dict) -> None:
    """`carried` (name -> state) into `opt` by its own `load_state_dict`, which puts each
    tensor on its parameter's device and dtype and `step` where that optimizer keeps it
    (fused or capturable: the parameter's device; else the host)."""
    index = {id(t): i for i, t in enumerate(t for g in opt.param_groups for t in g["params"])}
    state = {index[id(t)]: carried[n] for n, t in trainable if n in carried and id(t) in index}
    if state:
        opt.load_state_dict({"state": state, "param_groups": opt.state_dict()["param_groups"]})
