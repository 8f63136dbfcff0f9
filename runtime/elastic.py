"""Elastic pipelining at run time (PipeTransformer §3.2-3.3): switch to a shorter pipeline.

    shrinks = Shrinks.beside("out/bert_pipeline/plan.json")   # None: no elastic/ folder
    end = segment_end(first, steps, decides, shrinks.pending(gpus))
    ... the run trains steps first..end-1 on its plan ...
    nxt = shrinks.after(frozen, gpus, replicas, m)             # a shorter pipeline, or None
    carried = hand_over(modules, optimizers, mixed, replica, world)   # every rank, collective
    plan, stages = shrinks.load(nxt)                           # and the run goes on on it

`ftpipe compile --freeze-training ALPHA` writes, beside the package's plan, the plans of
the pipelines it may shrink to (`elastic/index.json`; `elastic/<name>/` holds each one's
plan.json and stages): the same model on GPUS/2, GPUS/4 ... GPUs of a pipeline with 2, 4 ...
times the replicas on the same ranks, each to be used once at least `frozen_layers`
layers are frozen. A run with freeze training (`--freeze-alpha`, `--freeze-at`) is cut
into segments that end at its freeze decisions while a shorter pipeline is left; after
a decision that froze enough, every rank hands over the weights it holds (the first
replica's: they are every replica's) and its optimizer state, by parameter name, and the
run goes on from the next step on the new plan: its stages are built on the ranks the new
plan gives them, load those tensors by name, freeze the same layers, and new process
groups are made for the new pipelines and replicas; each replica then reads its share of
every step's micro-batches (the micro-batches per replica shrink as the replicas grow, so
a step trains on the same samples). Segment boundaries are step boundaries of a
synchronous schedule, so nothing is in flight when the run switches.

The hand-over goes through `all_gather_object`: every rank holds the whole model's weights
and optimizer state for a moment (fine for the models freeze training is tested on here;
point-to-point sends of only what each new stage needs would not).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from .errors import PeerFailure, PipelineConfigError
from .stages import import_package
from .topology import read_plan

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
        plan = read_plan(where / "plan.json")
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
    tensors: dict  # name -> weight, buffers included (the first replica's)
    optimizer: dict  # parameter name -> its optimizer state
    losses: dict
    runlog: object = None
    segments: list = field(default_factory=list)


def hand_over(modules, optimizers, mixed, replica: int, world: int) -> tuple[dict, dict]:
    """(every weight, every trainable weight's optimizer state), by name, on every rank."""
    mine = ({}, {})
    if replica == 0:
        for s, mod in modules.items():
            mine[0].update(
                {n: t.detach().cpu().clone() for n, t in mixed.state_dict(s, mod).items()}
            )
            state = optimizers[s].state if optimizers.get(s) is not None else {}
            for n, t in mixed.trainable(s):
                if t in state:
                    mine[1][n] = {
                        k: v.detach().cpu().clone() if torch.is_tensor(v) else v
                        for k, v in state[t].items()
                    }
    everyone = [None] * world
    try:
        dist.all_gather_object(everyone, mine)
    except Exception as e:  # noqa: BLE001
        raise PeerFailure(f"a rank vanished while handing over the weights ({e})") from e
    tensors, opt = {}, {}
    for t, o in everyone:
        tensors.update(t)
        opt.update(o)
    return tensors, opt


def load_carried(carried: Carried, modules, optimizers, mixed, device) -> None:
    """The handed-over weights and optimizer state into this rank's new stages (after the
    same layers were frozen in them)."""
    for s, mod in modules.items():
        own = mod.state_dict()
        missing = sorted(set(own) - set(carried.tensors))
        if missing:
            raise PipelineConfigError(f"{missing[0]} was not handed over; compile again")
        mixed.load(s, mod, {k: carried.tensors[k] for k in own})
        opt = optimizers.get(s)
        if opt is None:
            continue
        for n, t in mixed.trainable(s):
            if n in carried.optimizer:
                opt.state[t] = {
                    k: v.to(device) if torch.is_tensor(v) and k != "step" else v
                    for k, v in carried.optimizer[n].items()  # Adam keeps its step on the host
                }
