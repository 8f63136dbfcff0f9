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
from ..train.zero import SHARDABLE, ShardedOptimizer
from .device import use_tf32
from .report import memory_meter
from .runlog import RunLog

__all__ = ["hyper_of", "lr_changes", "lr_of", "prepare_rank", "sharded_stages"]


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
    offload = _offload(args, run.place)
    sharded = _sharded(run)
    # after --init: the masters copy the weights
    mixed = MixedPrecision(run.precision, modules, offload=offload, sharded=sharded)
    mixed.say = say
    hyper = hyper_of(args)
    reps = run.place.reps
    mixed.sharded_over = reps.count if sharded else 1
    index = sorted(reps.stage_group(gpu)).index(rank)  # this rank's shards (`zero`)
    optimizers = {}
    for s in modules:
        trainable = [t for _, t in mixed.trainable(s)]
        optimizers[s] = (
            ShardedOptimizer(mixed, s, replicas=reps.count, index=index,
                             optimizer=args.optimizer, lr=args.lr, hyper=hyper)
            if s in sharded and trainable
            else make_optimizer(args.optimizer, trainable, args.lr, hyper)
        )  # fmt: skip
    torch.manual_seed(args.seed * 7919 + rank)  # the rank's own generator, repeats per run
    return modules, optimizers, mixed, exporter, runlog


def _offload(args, place) -> HostOffload | None:
    """--offload-optimizer: the masters and optimizer state on the host."""
    if not args.offload_optimizer:
        return None
    if place.reps.count > 1 and place.device.type == "cuda":
        # The replicas' all-reduce sums the gradients where the masters are; NCCL's cannot.
        raise PipelineConfigError(
            "--offload-optimizer does not run with data-parallel replicas on CUDA yet; leave it "
            "out, or compile the package with --replicas 1"
        )
    if TrainingMode.of(args).freezing and not args.no_shrink and place.device.type == "cuda":
        # The switch to a shorter plan hands masters and state over through the device.
        raise PipelineConfigError(
            "--offload-optimizer does not hand over to a shorter pipeline on CUDA yet; add "
            "--no-shrink to freeze on this plan, or leave --offload-optimizer out"
        )
    return HostOffload(place.device)


def sharded_stages(plan: dict, choice: bool | None) -> set[int]:
    """The plan's stages whose optimizer state is sharded across its replicas: every one
    (--shard-optimizer), none (--no-shard-optimizer), or those whose `shard_optimizer` the
    plan set (the compiler's choice; no flag)."""
    if choice is not None:
        return {int(st["id"]) for st in plan["stages"]} if choice else set()
    return {int(st["id"]) for st in plan["stages"] if st.get("shard_optimizer")}


def _sharded(run) -> set[int]:
    """This rank's stages whose optimizer state is sharded, or one sentence saying why it
    cannot be; the same on every rank (the plan's and the options' alone). None with one
    replica, where there is nothing to shard across."""
    args, reps = run.args, run.place.reps
    chosen = sharded_stages(run.plan, args.shard_optimizer)
    if not chosen:
        return set()
    if reps.count == 1:
        if args.shard_optimizer:
            run.say(
                "ftpipe: note: --shard-optimizer shards across data-parallel replicas and this "
                "package has one, so nothing is sharded (compile it with --replicas 2 or more)"
            )
        return set()
    if args.offload_optimizer:
        # Both place the masters; sharding them on the host is not written.
        raise PipelineConfigError(
            "--offload-optimizer and sharded optimizer state do not run together yet; pick "
            "one (--no-shard-optimizer overrides the plan's sharding)"
        )
    if args.optimizer.lower() not in SHARDABLE:
        raise PipelineConfigError(
            f"--optimizer {args.optimizer} cannot step a replica's slice of the weights "
            "(its state is per matrix, not per element), so its state cannot be sharded; "
            f"pick {', '.join(SHARDABLE)}, or add --no-shard-optimizer"
        )
    if run.mode.shrinks is not None:
        # The switch to a shorter plan moves whole tensors between ranks.
        raise PipelineConfigError(
            "sharded optimizer state does not hand over to a shorter pipeline yet; add "
            "--no-shrink to freeze on this plan, or --no-shard-optimizer"
        )
    return chosen


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
