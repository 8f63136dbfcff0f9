"""The run's state on this rank, typed: one frozen record per phase of `train.run`, each
made whole when its phase ends. A function of another module takes the records it reads
(or the few values it needs), so what exists when is in the signatures, not in which phase
happened to run before.

    settled = Settled(plan=..., config=..., place=..., topo=..., ckpt=..., ...)  # train.py
    prepared = prepare_rank(settled)         # this rank's stages, precision, optimizers
    connected = Connected(first=..., timeline=..., flow=..., comm=..., ...)       # train.py
    built = Built(progress=..., stepper=..., executor=..., ...)                   # train.py
    finish(settled, prepared, built, first=..., wall=..., segments=...)

The records hold the parts themselves (modules, optimizers, process groups), which change
as the run trains; only which parts there are is fixed.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pathlib import Path

    from torch import nn

    from ..checkpoint.saver import Saver
    from ..checkpoint.store import Checkpoints
    from ..data.sources import HFExporter, Sources
    from ..engine.comm import Comm
    from ..engine.dataflow import Dataflow
    from ..engine.executor import Executor
    from ..freeze.elastic import Carried
    from ..freeze.layers import FreezeTraining
    from ..freeze.mode import TrainingMode
    from ..schedules import Schedule, Timeline
    from ..spec.topology import Topology
    from ..train.precision import MixedPrecision, Precision
    from ..train.replicas import Shard
    from ..train.stepping import Stepper
    from .config import RunConfig
    from .ranks import Place
    from .report import Progress
    from .runlog import RunLog

__all__ = ["Built", "Connected", "Prepared", "Settled"]


@dataclass(frozen=True, slots=True)
class Settled:
    """What is fixed before any rank waits for another: what every rank finds alike (the
    plan, the options, the schedule, the data, the checkpoints) and this rank's place."""

    plan: dict
    stage_classes: dict  # stage id -> the package's class
    config: RunConfig  # --steps settled (`RunConfig.with_steps`: --epochs on the data)
    mode: TrainingMode
    carried: Carried | None  # what the previous plan hands over (freeze training)
    place: Place
    say: Callable[[str], None]  # rank 0's notes (the other ranks': silent)
    schedule_name: str  # --schedule, or the plan's
    schedule: Schedule
    micro_batches: int  # of a step, on each replica
    precision: Precision
    topo: Topology  # messages in the compute dtype
    sources: Sources
    data: Shard  # this replica's share of the training data
    stop: int  # the step this plan's segment ends at (freeze training), else --steps
    root: Path  # this plan's checkpoint folder
    ckpt: Checkpoints


@dataclass(frozen=True, slots=True)
class Prepared:
    """This rank's own parts, made before the ranks meet (`prepare.prepare_rank`)."""

    modules: dict[int, nn.Module]  # stage id -> its module, built on this rank's device
    optimizers: dict  # stage id -> its optimizer (or its sharded one, `train.zero`)
    mixed: MixedPrecision  # masters, gradients, loss scale (and the host's share: offload)
    exporter: HFExporter | None  # --save-hf
    runlog: RunLog | None  # --log-dir and the like (the previous plan's, under freeze training)


@dataclass(frozen=True, slots=True)
class Connected:
    """After the ranks meet: the step this segment starts from (--resume's checkpoint, or
    where the previous plan ended), its actions and the messages between the ranks."""

    first: int
    manifest: dict | None  # the resumed checkpoint's
    timeline: Timeline  # the action lists, a window at a time
    flow: Dataflow
    comm: Comm


@dataclass(frozen=True, slots=True)
class Built:
    """The executor and what it calls, ready to execute."""

    progress: Progress  # the losses, the step's figures, rank 0's log
    freezer: FreezeTraining | None  # freeze training's part on this rank
    saver: Saver
    stepper: Stepper
    executor: Executor
    on_eval: Callable  # (step, results): an evaluation round's results
    samples: int  # of a step, every replica's
