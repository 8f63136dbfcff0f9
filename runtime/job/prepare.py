"""This rank's own set-up before the ranks meet: what it will write is checked writable,
its stages are built (with --init weights), their precision and optimizers made.

    prepared = prepare_rank(settled)     # a `context.Prepared`

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
from ..train.offload import HostOffload, may_lag
from ..train.optim import make_optimizer
from ..train.precision import MixedPrecision
from ..train.zero import SHARDABLE, ShardedOptimizer
from .config import RunConfig
from .context import Prepared, Settled
from .device import use_tf32
from .memory import memory_meter
from .runlog import RunLog
from .spare_inputs import check_outputs_spare_inputs

__all__ = ["lr_changes", "prepare_rank", "sharded_stages"]


def prepare_rank(settled: Settled) -> Prepared:
    """This rank's checks and set-up: its --log-json and --trace, its checkpoint folder, its
    export and log, its stages and --init weights, their precision and optimizers."""
    config, ckpt, say, precision = settled.config, settled.ckpt, settled.say, settled.precision
    plan, carried, place, topo = settled.plan, settled.carried, settled.place, settled.topo
    rank, gpu = place.rank, place.gpu
    check_outputs_spare_inputs(config, plan, settled.stage_classes)
    if config.log_json and rank == 0:
        check_writable_file(config.log_json, "--log-json")
    if config.trace and rank == 0:
        check_writable_file(config.trace, "--trace")
    if config.save_every:
        _check_folder(ckpt.root)
        if not (config.resume or config.overwrite_checkpoints):
            ckpt.refuse_foreign()
    exporter = HFExporter(plan, config, ckpt, say) if config.save_hf else None
    wanted = config.log_dir or config.log_jsonl or config.tensorboard or config.wandb
    runlog = None
    if wanted and not carried:
        runlog = RunLog(
            config.log_dir, rank, say=say, jsonl=config.log_jsonl, tensorboard=config.tensorboard,
            wandb=config.wandb, config=config.to_dict(),
        )  # fmt: skip
    runlog = carried.runlog if carried else runlog
    memory_meter(str(place.device), dtype=precision.dtype)  # before any stage: what they add counts
    use_tf32(place.device, config.tf32)
    modules = build_stages(topo, settled.stage_classes, gpu, place.device, precision.dtype)
    if config.init:
        load_init(modules, config.init, plan)
    planned = topo.offload_optimizer & set(modules)  # the plan's per-stage choice
    offload = _offload(config, place, planned)
    if offload is not None:  # the plan's stages whose gradients sum on the GPU, sent once a step
        offload.on_device = topo.sums_on_device & planned
        offload.lagged = _lagged(settled, set(modules) if config.offload_optimizer else planned)
    offloaded = None if config.offload_optimizer else planned  # the flag: every stage
    sharded = _sharded(
        plan, config, replicas=place.reps.count, shrinking=settled.mode.shrinks is not None, say=say
    )
    if sharded & planned:
        raise PipelineConfigError(
            f"the plan offloads stage {min(sharded & planned)}'s optimizer state to the host and "
            "--shard-optimizer shards it across replicas; they do not run together yet: add "
            "--no-shard-optimizer"
        )
    # after --init: the masters copy the weights
    mixed = MixedPrecision(
        precision, modules, offload=offload, offloaded=offloaded, sharded=sharded
    )
    mixed.say = say
    if topo.offload_optimizer and not config.offload_optimizer:  # said once (rank 0's say)
        stages = ", ".join(map(str, sorted(topo.offload_optimizer)))
        say(f"ftpipe: the plan keeps the master weights and optimizer state of stages {stages} "
            "in host memory and steps them on the CPU")  # fmt: skip
    hyper = config.hyper
    reps = place.reps
    mixed.sharded_over = reps.count if sharded else 1
    index = sorted(reps.stage_group(gpu)).index(rank)  # this rank's shards (`zero`)
    optimizers = {}
    for s in modules:
        trainable = [t for _, t in mixed.trainable(s)]
        optimizers[s] = (
            ShardedOptimizer(mixed, s, replicas=reps.count, index=index,
                             optimizer=config.optimizer, lr=config.lr, hyper=hyper)
            if s in sharded and trainable
            else make_optimizer(config.optimizer, trainable, config.lr, hyper)
        )  # fmt: skip
    torch.manual_seed(config.seed * 7919 + rank)  # the rank's own generator, repeats per run
    return Prepared(modules, optimizers, mixed, exporter, runlog)


def _lagged(settled: Settled, offloaded: set[int]) -> frozenset[int]:
    """The offloaded stages whose steps land at their next S: --offload-step, else the plan's
    per-stage choice, where the schedule's actions read the weights as they are (FTPipe's);
    under any other the step lands exactly (said once)."""
    config, topo = settled.config, settled.topo
    chosen = offloaded if config.offload_step == "lagged" else set()
    if config.offload_step is None:
        chosen = offloaded & topo.lagged
    if not chosen:
        return frozenset()
    policies = settled.schedule.policies(topo.stage_infos(), settled.micro_batches)
    asynchronous = {s for s in chosen if may_lag(policies[s])}
    if asynchronous != chosen:
        settled.say(
            f"ftpipe: note: under {settled.schedule_name} an offloaded step lands where the "
            "stage's weights are next read (--offload-step exact): lagged steps need the "
            "ftpipe schedule"
        )
    return frozenset(asynchronous)


def _offload(config, place, planned=frozenset()) -> HostOffload | None:
    """The host's side of the masters and optimizer state: --offload-optimizer (every stage),
    or the stages of this rank the plan offloads (`planned`: its per-stage `offload`)."""
    if not (config.offload_optimizer or planned):
        return None
    what = (
        "--offload-optimizer"
        if config.offload_optimizer
        else f"the plan's offload of stage {min(planned)}'s optimizer"
    )
    undo = (
        "leave it out"
        if config.offload_optimizer
        else "compile the package again with --offload none"
    )
    if place.reps.count > 1 and place.device.type == "cuda":
        # The replicas' all-reduce sums the gradients where the masters are; NCCL's cannot.
        raise PipelineConfigError(
            f"{what} does not run with data-parallel replicas on CUDA yet; {undo}, or compile "
            "the package with --replicas 1"
        )
    if TrainingMode.of(config).freezing and not config.no_shrink and place.device.type == "cuda":
        # The switch to a shorter plan hands masters and state over through the device.
        raise PipelineConfigError(
            f"{what} does not hand over to a shorter pipeline on CUDA yet; add --no-shrink to "
            f"freeze on this plan, or {undo}"
        )
    return HostOffload(place.device)


def sharded_stages(plan: dict, choice: bool | None) -> set[int]:
    """The plan's stages whose optimizer state is sharded across its replicas: every one
    (--shard-optimizer), none (--no-shard-optimizer), or those whose `shard_optimizer` the
    plan set (the compiler's choice; no flag)."""
    if choice is not None:
        return {int(st["id"]) for st in plan["stages"]} if choice else set()
    return {int(st["id"]) for st in plan["stages"] if st.get("shard_optimizer")}


def _sharded(plan: dict, config: RunConfig, *, replicas: int, shrinking: bool, say) -> set[int]:
    """This rank's stages whose optimizer state is sharded, or one sentence saying why it
    cannot be; the same on every rank (the plan's and the options' alone). None with one
    replica, where there is nothing to shard across. `shrinking`: freeze training may switch
    to a shorter plan."""
    chosen = sharded_stages(plan, config.shard_optimizer)
    if not chosen:
        return set()
    if replicas == 1:
        if config.shard_optimizer:
            say(
                "ftpipe: note: --shard-optimizer shards across data-parallel replicas and this "
                "package has one, so nothing is sharded (compile it with --replicas 2 or more)"
            )
        return set()
    if config.offload_optimizer:
        # Both place the masters; sharding them on the host is not written.
        raise PipelineConfigError(
            "--offload-optimizer and sharded optimizer state do not run together yet; pick "
            "one (--no-shard-optimizer overrides the plan's sharding)"
        )
    if config.optimizer.lower() not in SHARDABLE:
        raise PipelineConfigError(
            f"--optimizer {config.optimizer} cannot step a replica's slice of the weights "
            "(its state is per matrix, not per element), so its state cannot be sharded; "
            f"pick {', '.join(SHARDABLE)}, or add --no-shard-optimizer"
        )
    if shrinking:
        # The switch to a shorter plan moves whole tensors between ranks.
        raise PipelineConfigError(
            "sharded optimizer state does not hand over to a shorter pipeline yet; add "
            "--no-shrink to freeze on this plan, or --no-shard-optimizer"
        )
    return chosen


def lr_changes(config: RunConfig, saved_steps, first: int) -> bool:
    """Does --steps (which the learning-rate decay depends on) change the rates from `first`?"""
    if not isinstance(saved_steps, int) or saved_steps == config.steps:
        return False
    return any(config.lr_at(k, saved_steps) != config.lr_at(k) for k in range(first, config.steps))


def _check_folder(root: Path) -> None:
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise PipelineConfigError(
            f"cannot make the checkpoint folder {root}: {e.strerror}"
        ) from None
    check_writable_folder(root, f"checkpoints in {root}")
