"""This rank's own set-up before the ranks meet: what it will write is checked writable,
its stages are built (with --init weights), their precision and optimizers made.

    modules, optimizers, mixed, exporter, runlog = prepare_rank(run, rank, gpu)

A failure here is told to the other ranks at the meeting (`ranks.agree_to_start`), so the
whole run stops naming this rank. Also: whether a resumed run's learning rates change
(`lr_changes`).
"""

from __future__ import annotations

from pathlib import Path

import torch

from ..atomic import check_writable_file, check_writable_folder
from ..data.sources import HFExporter
from ..errors import PipelineConfigError
from ..freeze.mode import TrainingMode
from ..stage.package import build_stages, load_init
from ..train.offload import HostOffload
from ..train.optim import Hyper, lr_at, make_optimizer
from ..train.precision import MixedPrecision
from .device import use_tf32
from .report import memory_meter
from .runlog import RunLog

__all__ = ["hyper_of", "lr_changes", "lr_of", "prepare_rank"]


def prepare_rank(run, rank: int, gpu: int):
    """This rank's checks and set-up: its --log-json and --trace, its checkpoint folder, its
    export and log, its stages and --init weights, their precision and optimizers. `run`:
    the run's settled state (`run._Run`: plan, args, topo, ckpt, place, precision, say)."""
    plan, args, ckpt, carried, say = run.plan, run.args, run.ckpt, run.carried, run.say
    if args.log_json and rank == 0:
        check_writable_file(args.log_json, "--log-json")
    if args.trace and rank == 0:
        check_writable_file(args.trace, "--trace")
    if args.save_every:
        _check_folder(ckpt.root)
        if not (args.resume or args.overwrite_checkpoints):
            ckpt.refuse_foreign()
    exporter = HFExporter(plan, args, ckpt, say) if args.save_hf else None
    wanted = args.log_dir or args.log_jsonl or args.tensorboard or args.wandb
    runlog = None
    if wanted and not carried:
        runlog = RunLog(
            args.log_dir, rank, say=say, jsonl=args.log_jsonl, tensorboard=args.tensorboard,
            wandb=args.wandb, config=vars(args),
        )  # fmt: skip
    runlog = carried.runlog if carried else runlog
    memory_meter(str(run.place.device))  # started before any stage exists: what they add counts
    use_tf32(run.place.device, args.tf32)
    modules = build_stages(run.topo, run.stage_classes, gpu, run.place.device, run.precision.dtype)
    if args.init:
        load_init(modules, args.init, plan)
    planned = run.topo.offload_optimizer & set(modules)  # the plan's per-stage choice
    offload = _offload(args, run.place, planned)
    offloaded = None if args.offload_optimizer else planned  # the flag: every stage
    # after --init: the masters copy the weights
    mixed = MixedPrecision(run.precision, modules, offload=offload, offloaded=offloaded)
    mixed.say = say
    if run.topo.offload_optimizer and not args.offload_optimizer:  # said once (rank 0's say)
        stages = ", ".join(map(str, sorted(run.topo.offload_optimizer)))
        say(f"ftpipe: the plan keeps the master weights and optimizer state of stages {stages} "
            "in host memory and steps them on the CPU")  # fmt: skip
    hyper = hyper_of(args)
    optimizers = {
        s: make_optimizer(args.optimizer, [t for _, t in mixed.trainable(s)], args.lr, hyper)
        for s in modules
    }
    torch.manual_seed(args.seed * 7919 + rank)  # the rank's own generator, repeats per run
    return modules, optimizers, mixed, exporter, runlog


def _offload(args, place, planned=frozenset()) -> HostOffload | None:
    """The host's side of the masters and optimizer state: --offload-optimizer (every stage),
    or the stages of this rank the plan offloads (`planned`: its per-stage `offload`)."""
    if not (args.offload_optimizer or planned):
        return None
    what = (
        "--offload-optimizer"
        if args.offload_optimizer
        else f"the plan's offload of stage {min(planned)}'s optimizer"
    )
    undo = (
        "leave it out"
        if args.offload_optimizer
        else "compile the package again with --offload none"
    )
    if place.reps.count > 1 and place.device.type == "cuda":
        # The replicas' all-reduce sums the gradients where the masters are; NCCL's cannot.
        raise PipelineConfigError(
            f"{what} does not run with data-parallel replicas on CUDA yet; {undo}, or compile "
            "the package with --replicas 1"
        )
    if TrainingMode.of(args).freezing and not args.no_shrink and place.device.type == "cuda":
        # The switch to a shorter plan hands masters and state over through the device.
        raise PipelineConfigError(
            f"{what} does not hand over to a shorter pipeline on CUDA yet; add --no-shrink to "
            f"freeze on this plan, or {undo}"
        )
    return HostOffload(place.device)


def hyper_of(args) -> Hyper:
    """The optimizer's settings of the command line."""
    return Hyper(args.weight_decay, (args.adam_beta1, args.adam_beta2), args.adam_epsilon)


def lr_of(args, k: int, steps: int) -> float:
    """The command line's learning rate at optimizer step k of `steps`."""
    return lr_at(k, args.lr, steps, args.warmup, args.decay, args.decay_fraction)


def lr_changes(args, saved_steps, first: int) -> bool:
    """Does --steps (which the learning-rate decay depends on) change the rates from `first`?"""
    if not isinstance(saved_steps, int) or saved_steps == args.steps:
        return False
    rate = lambda k, steps: lr_of(args, k, steps)  # noqa: E731
    return any(rate(k, saved_steps) != rate(k, args.steps) for k in range(first, args.steps))


def _check_folder(root: Path) -> None:
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise PipelineConfigError(
            f"cannot make the checkpoint folder {root}: {e.strerror}"
        ) from None
    check_writable_folder(root, f"checkpoints in {root}")
