"""`ftpipe_runtime.run(plan, stages, argv)`: train the pipeline on this rank (torchrun).

    torchrun --nproc_per_node 2 -m t5_tiny_pipeline --steps 20 --schedule gpipe
    RANK=0 WORLD_SIZE=2 python tests/runtime/runtime_toy.py plan.json \
        --init-method file:///tmp/x/store ...               # (and RANK=1 beside it)

Rank r builds only the stages on GPU r, executes its action list of the schedule, and
rank 0 logs the loss of every step (options: `options.py`). With data parallelism the plan
places `replicas` copies of the pipeline on the ranks (`ftpipe_runtime.replicas`): a rank
runs one GPU of one replica, reads that replica's share of every batch, and sums its
stages' gradients with the same GPU of the other replicas before each step. The actions are
made a step window at a time (`schedules.Timeline`), so starting takes as long for 100,000 steps as for
10. A peer that dies or stops answering makes this rank print which rank it waited for and
exit with status 1 (`os._exit`: a process group with a dead member cannot be shut down
cleanly); a rank that cannot start (a wrong `--init`, say) tells the others when they meet,
and they all stop naming it. Every wait, the meeting included, lasts at most --timeout.
FTPIPE_FAULT=rank:step:exit|hang makes a rank fail after that step, for tests of exactly that.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from . import checkpoint
from .atomic import (
    check_writable_file,
    check_writable_folder,
    remove_temporaries,
    write_atomic,
)
from .comm import Comm, init_distributed
from .dataflow import Dataflow
from .elastic import Carried, Shrinks, hand_over, load_carried, segment_end
from .errors import PeerFailure, PipelineConfigError, WriteFailed
from .evaluate import Evaluator, loss_messages, reporter, splicer
from .executor import Executor
from .finetune import HFExporter, open_sources
from .freezing import FreezeTraining
from .optim import lr_at, make_optimizer
from .options import parse_args
from .precision import MixedPrecision, for_run, plan_in
from .replicas import GradSync, LossGather, Replicas, Shard, launch_hint
from .report import Progress, checksums, human_bytes, peak_memory
from .runlog import RunLog
from .schedules import Timeline, resolve_schedule
from .stages import build_stages, load_init
from .stepping import Stepper
from .topology import Topology, read_plan
from .trace import Tracer, write_trace


def run(plan: dict | str | os.PathLike, stages: dict, argv: list[str] | None = None) -> dict:
    """Train this rank's stages; returns the run's summary (losses on rank 0).

    `plan` is the plan dict or the path of plan.json; either is checked before anything runs.
    """
    rank = int(os.environ.get("RANK", 0))
    argv_plan = plan
    try:
        plan = read_plan(plan) if not isinstance(plan, dict) else plan
        Topology(plan)  # before the arguments, whose defaults come from the plan
    except PipelineConfigError as e:
        raise SystemExit(f"ftpipe: {e}") from None
    args = parse_args(argv, plan)
    try:
        # Freeze training on a package compiled with --freeze-training: segments, each on
        # its plan, the next one shorter (ftpipe_runtime.elastic).
        path = None if args.no_shrink else _path_of(argv_plan)
        shrinks = Shrinks.beside(path) if path else None
        carried = None
        while isinstance(got := _train(plan, stages, args, rank, shrinks, carried), Carried):
            carried, plan, stages = got, got.plan, got.stages
        return got
    except PeerFailure as e:
        _die(f"ftpipe rank {rank}: {e}", 1)
    except (PipelineConfigError, WriteFailed) as e:
        if dist.is_initialized():  # the others would wait for this rank: do not linger
            _die(f"ftpipe rank {rank}: {e}", 1)
        raise SystemExit(f"ftpipe: {e}") from None


def _path_of(plan) -> Path | None:
    return None if isinstance(plan, dict) else Path(plan)


def _die(message: str, code: int):
    print(message, file=sys.stderr, flush=True)
    sys.stdout.flush()
    os._exit(code)


def _train(plan: dict, stage_classes: dict, args, rank: int, shrinks=None, carried=None):
    """The run's summary, or what it hands to the next, shorter plan (`Carried`)."""
    world = int(os.environ.get("WORLD_SIZE", 1))
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    topo = Topology(plan)
    reps = Replicas.of(plan)
    if world != reps.world:
        raise PipelineConfigError(
            f"the plan is for {reps.world} GPUs but {world} processes started; run "
            f"torchrun {launch_hint(plan)} ..."
        )
    replica, gpu = reps.where(rank)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise PipelineConfigError("--device cuda, but torch sees no GPU here; use --device cpu")
    device = torch.device(f"cuda:{local_rank}" if args.device == "cuda" else "cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    elif "OMP_NUM_THREADS" not in os.environ:
        per_node = int(os.environ.get("LOCAL_WORLD_SIZE", world))
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // per_node))
    name = args.schedule or plan["schedule"]
    sched = resolve_schedule(name)
    if not plan.get("recompute", True) and sched.can_keep_activations:
        sched = sched.without_recompute()  # the planner chose to keep activations
    m = args.micro_batches or sched.micro_batches or int(plan["micro_batches"])
    m = carried.micro_batches if carried else m
    precision = for_run(plan, args.dtype, sched)
    topo = Topology(plan_in(plan, precision))  # messages in the run's compute dtype
    # Everything that can be refused is refused before any rank waits for another: first
    # what every rank finds alike (the data, which settles --steps under --epochs; the
    # schedule's lists on this plan: a CSV file that skips or deadlocks), then what is this
    # rank's own, which the others hear of when they meet.
    say = (lambda line: print(line, file=sys.stderr, flush=True)) if rank == 0 else _quiet
    sources = open_sources(plan, args, m, say)
    if reps.count > 1 and (sources.eval is not None or args.save_hf):
        raise PipelineConfigError(
            "evaluation and --save-hf do not run with data-parallel replicas yet; leave them "
            "out, or compile the package with --replicas 1"
        )
    data = Shard(sources.train, replica, reps.count, m)
    freezing = args.freeze_alpha is not None or bool(args.freeze_at)
    shrinks = shrinks if freezing else None
    first = carried.first if carried else 0
    pending = bool(shrinks and shrinks.pending(topo.world))
    end = segment_end(first, args.steps, _decides(args), pending)
    if end < args.steps and (sources.eval is not None or args.save_hf or args.trace):
        raise PipelineConfigError(
            "evaluation, --save-hf and --trace do not run with a pipeline that shrinks yet "
            "(elastic/ beside the plan); leave them out, or compile without --freeze-training"
        )
    timeline = Timeline(sched, topo.stage_infos(), m, end, drain_every=args.save_every)
    # With evaluation rounds after every step: the most there can be (`Timeline.check`).
    every_step = lambda n: splicer(topo, m, sources.eval, steps=n, first=0, every=1)  # noqa: E731
    timeline.check(topo.stage_graph(), every_step)
    root = Path(args.checkpoint_dir or checkpoint.default_dir(plan))
    root = root / carried.name if carried else root  # each plan's checkpoints its own
    ckpt = checkpoint.Checkpoints(
        root, rank, world, checkpoint.run_identity(plan, args, name, m), args.keep_checkpoints, say
    )
    failure = None
    try:
        modules, optimizers, mixed, exporter, runlog = _prepare(
            plan, stage_classes, args, (rank, gpu), topo, ckpt, device, precision, say, carried
        )
    except Exception as e:  # noqa: BLE001 - told to the other ranks first, then raised
        failure = e
    init_distributed(rank, world, device.type, args.init_method, args.timeout)
    _agree_to_start(failure, rank, world)

    if args.resume:
        first, manifest = ckpt.choose(lambda v: _all_gather(v, world))
    else:
        manifest = None
    if first >= args.steps:
        raise PipelineConfigError(f"the checkpoint is at step {first}; ask for more --steps")
    if manifest and _lr_changes(args, manifest.get("steps"), first):
        say(
            f"ftpipe: note: the checkpoint's run had --steps {manifest['steps']}, this one "
            f"{args.steps}; the learning-rate schedule changes from step {first}"
        )
    if rank == 0 and (args.save_every or args.resume):
        remove_temporaries(root)  # of a killed save; nobody saves before the barrier below

    if first:  # the pipeline fills again from the checkpoint's step
        timeline = timeline.resumed(first)
        timeline.check(topo.stage_graph(), every_step)
    rounds = dict(data=sources.eval, steps=args.steps, every=args.eval_every)
    flow = Dataflow(topo, timeline, splicer(topo, m, first=first, **rounds))
    comm = Comm(
        gpu,
        topo.world,
        device,
        args.timeout,
        flow,
        _message_specs(topo),
        reps,
        replica,
        ahead_bytes=int(args.post_ahead * 2**20),
    )
    # The collectives: the gradient norm across a pipeline's ranks when a synchronous step
    # clips (fp16's overflow check rides on it: the norm is computed then even without
    # clipping), and each GPU's gradients with its replicas.
    if freezing and not sched.synchronous:
        raise PipelineConfigError(
            f"freeze training needs a synchronous schedule, not {name}; pick gpipe or 1f1b"
        )
    collective = sched.synchronous and (args.clip or precision.loss_scaling or freezing)
    collective_sets = [tuple(range(topo.world))] if collective else []
    dp_sets = [reps.stage_group(g) for g in range(topo.world)] if reps.count > 1 else []
    loss_rank = topo.rank_of[topo.loss_stage]
    comm.make_groups(collective_sets, loss_rank, dp_sets)

    micro_batch = next(iter(plan["model"]["inputs"].values()))[0][0]
    lr_of = lambda k: lr_at(k, args.lr, args.steps, args.warmup, args.decay)  # noqa: E731
    samples = reps.count * m * micro_batch
    progress = Progress(rank == 0, args.steps, first, samples, args.log_every)
    progress.log, progress.lr_of = runlog, lr_of
    if carried:
        progress.losses.update(carried.losses)
    if args.resume:
        where = f"step {first} of {root}" if first else f"step 0: no checkpoint in {root}"
        if rank == 0:
            progress.write(f"resuming from {where}")
    freezer = _freezer(plan, args, modules, optimizers, mixed, comm, progress, runlog, freezing)
    if carried:  # the same layers frozen, then the weights and state handed over loaded
        freezer.start_frozen(carried.frozen)
        load_carried(carried, modules, optimizers, mixed, device)
    saver = checkpoint.Saver(ckpt, args.save_every, args.steps, m, stages=replica == 0)
    saver.modules, saver.optimizers, saver.precision = modules, optimizers, mixed
    stepper = Stepper(
        topo,
        gpu,
        modules,
        optimizers,
        comm,
        lr_of,
        args.clip,
        _after_steps(
            saver if args.save_every else None,
            (lambda ev, k: exporter.after_checkpoint()) if exporter and rank == 0 else None,
            (lambda ev, k: runlog.memory(k + 1, peak_memory(device))) if runlog else None,
            freezer.after_step if freezer else None,
        ),
        precision=mixed,
    )
    stepper.on_grads = freezer.measure if freezer else None
    executor = Executor(
        topo,
        gpu,
        modules,
        flow,
        comm,
        data,
        stepper,
        m,
        device,
        on_loss=progress.loss,
        seed=args.seed,
    )
    executor.loss_scale = mixed.multiplier
    on_eval = reporter(plan, args.steps, first, args.eval_every, progress)
    if sources.eval is not None:  # its results tagged after every step's loss
        evaluator = Evaluator(topo, gpu, modules, comm, sources.eval, device, args.steps, on_eval)
        executor.handlers["E"] = evaluator.forward
    if reps.count > 1:
        sync = GradSync(modules, comm, reps.stage_group(gpu), m)
        executor.grad_sync = stepper.grad_sync = sync
        if freezer:
            freezer.grad_sync = sync
    saver.versions, saver.drained = executor.kept_versions, timeline.drains
    if first and not carried:
        for s, mod in modules.items():
            load = lambda t, s=s, mod=mod: mixed.load(s, mod, t)  # noqa: E731
            ckpt.load_stage(first, s, mod, optimizers[s], device, load)
        ckpt.load_rank(first)
        mixed.restore((manifest or {}).get("state", {}))
        executor.restore_versions(ckpt.load_versions(first))
    fault = _fault(rank)

    def after(i, item):
        if fault and item.ends_step == fault[0]:
            comm.finish()
            if fault[1] == "hang":
                time.sleep(3600)
            _die(f"ftpipe rank {rank}: FTPIPE_FAULT stops this rank", 3)

    _barrier(world, "starting")
    executor.tracer = tracer = Tracer(comm, keep=bool(args.trace))
    tracer.start()
    listener = None
    if rank == 0 and reps.count > 1:  # every replica's losses, one step's together
        heads = [reps.rank(r, loss_rank) for r in range(reps.count)]
        gather = LossGather(heads, progress.loss)
        executor.on_loss = lambda k, msg: gather.add(k, 0, msg)
        messages = (  # made as the listener needs them, from the loss rank's actions
            (src, k, m + 1, lambda msg, k=k, src=src: gather.add(k, src, msg))
            for _, k in loss_messages(flow.listed(loss_rank), topo.loss_stage, m, 1)
            for src in heads
            if src != 0
        )
        listener = comm.listen_losses(messages)
    elif rank == 0 and loss_rank != 0:
        n = sources.eval.micro_batches if sources.eval is not None else 1
        messages = (  # made as the listener needs them, from the loss rank's actions
            (loss_rank, k, m + 1, lambda msg, k=k: progress.loss(k, msg))
            if kind == "loss"
            else (loss_rank, args.steps + k, 3, lambda msg, k=k: on_eval(k, msg))
            for kind, k in loss_messages(flow.listed(loss_rank), topo.loss_stage, m, n)
        )
        listener = comm.listen_losses(messages)
    start = time.perf_counter()
    executor.run(flow.actions(gpu), after)
    if listener is not None:
        listener.join(args.timeout)
        if listener.is_alive() or comm.listener_error:
            why = comm.listener_error or f"nothing for {args.timeout:.0f} s"
            raise PeerFailure(f"rank 0 gave up waiting for the losses of the loss stage: {why}")
    comm.finish()
    wall = time.perf_counter() - start
    if end < args.steps:
        return _switch((plan, stage_classes), args, (rank, world, replica, reps),
                       (first, end, m, wall, samples),
                       (modules, optimizers, mixed, freezer, progress, runlog), shrinks,
                       carried)  # fmt: skip
    segments = _segment(carried.segments if carried else [], first, end, reps, samples, wall,
                        progress.times)  # fmt: skip
    if rank == 0 and carried:
        progress.write(_segment_line(segments[-1]))
    wall = sum(row["wall_s"] for row in segments)  # of every plan's steps
    if args.trace:  # every rank's actions, written by rank 0
        mine = {"rank": rank, "gpu": gpu, "replica": replica, "actions": tracer.rows}
        mine["sent"] = comm.sent  # kind -> [messages, bytes]: what crossed to other ranks
        ranks = _all_gather(mine, world)
        if rank == 0:
            meta = {"schedule": name, "micro_batches": m, "steps": args.steps, "first": first}
            write_trace(args.trace, ranks, meta)
    progress.close()
    if exporter is not None:  # every rank sends its tensors, rank 0 writes the folder
        _barrier(world, "saving the HuggingFace folder")
        mine = {  # frozen weights too (a checkpoint leaves them out)
            k: v
            for s, mod in modules.items()
            for k, v in {**mod.state_dict(), **mixed.state_dict(s, mod)}.items()
        }
        traced = plan["model"].get("compute_dtype", "float32")
        exporter.at_end(mine, rank, world, device, lambda p: mixed.saved_dtype(p, traced))
    if runlog is not None:
        runlog.close()
    start = carried.start if carried else first
    return _finish(
        args,
        plan,
        modules,
        progress,
        device,
        (world, rank, replica),
        start,
        m,
        wall,
        mixed,
        segments,
    )


def _freezer(plan, args, modules, optimizers, mixed, comm, progress, runlog, on):
    """Freeze training's part on this rank (None: off); its decisions are said by rank 0,
    recorded in the run log and kept for the summary (`args.freeze_decisions`)."""
    if not on:
        return None
    if args.resume:
        raise PipelineConfigError(
            "freeze training does not resume from a checkpoint yet; start the run again"
        )
    if not hasattr(args, "freeze_decisions"):  # kept across the plans of one run
        args.freeze_decisions = []

    def record(row):
        args.freeze_decisions.append({k: v for k, v in row.items() if k != "norms"})
        if row["frozen"] > row["before"]:
            progress.write(
                f"step {row['step']}: {row['frozen']} of {row['layers']} layers frozen "
                f"({row['by']}; bound {row['bound']})"
            )
        if runlog is not None:
            runlog.record("freeze", **row)

    try:
        return FreezeTraining(plan, modules, optimizers, mixed, comm, alpha=args.freeze_alpha,
                              every=args.freeze_every, forced=dict(args.freeze_at),
                              record=record)  # fmt: skip
    except ValueError as e:
        raise PipelineConfigError(str(e)) from None


def _decides(args):
    """Is a freeze decision taken after step k (0-based)? (`FreezeTraining.due`)"""
    forced = {s for s, _ in args.freeze_at}
    alpha, every = args.freeze_alpha, args.freeze_every
    return lambda k: k + 1 in forced or (alpha is not None and (k + 1) % every == 0)


def _switch(current, args, where, span, state, shrinks, carried):
    """At a segment's end: hand everything over to the next plan (or the same one, when
    the decision did not freeze enough for a shorter pipeline)."""
    rank, world, replica, reps = where
    first, end, m, wall, samples = span
    modules, optimizers, mixed, freezer, progress, runlog = state
    progress.close()
    segments = _segment(carried.segments if carried else [], first, end, reps, samples, wall,
                        progress.times)  # fmt: skip
    if rank == 0:
        progress.write(_segment_line(segments[-1]))
    nxt = shrinks.after(freezer.frozen, reps.gpus, reps.count, m)
    tensors, opt = hand_over(modules, optimizers, mixed, replica, world)
    if nxt is None:
        name, (new_plan, stages), new_m = (carried.name if carried else ""), current, m
    else:
        new_plan, stages = shrinks.load(nxt)
        name, new_m = nxt.name, m * reps.count // nxt.replicas
        if rank == 0:
            progress.write(
                f"step {end}: {freezer.frozen} layers frozen: switching to {nxt.replicas} "
                f"replicas x {nxt.gpus} GPUs ({nxt.name})"
            )
    return Carried(
        first=end, start=carried.start if carried else first, name=name, plan=new_plan,
        stages=stages,
        micro_batches=new_m, frozen=freezer.frozen, tensors=tensors, optimizer=opt,
        losses=dict(progress.losses), runlog=runlog, segments=segments,
    )  # fmt: skip


def _segment(done: list, first: int, end: int, reps, samples: int, wall: float, ends) -> list:
    """`ends`: step -> seconds from the segment's start to the end of the step's forwards on
    the loss stage (rank 0 hears them with the losses; benchmarks time steps by them)."""
    row = {"steps": [first, end], "replicas": reps.count, "gpus": reps.gpus,
           "wall_s": wall, "samples_per_s": (end - first) * samples / wall if wall > 0 else 0.0,
           "step_ends_s": [ends[k] for k in sorted(ends)]}  # fmt: skip
    return [*done, row]


def _segment_line(row: dict) -> str:
    a, b = row["steps"]
    return (
        f"steps {a + 1}-{b} on {row['replicas']} replicas x {row['gpus']} GPUs: "
        f"{row['samples_per_s']:.1f} samples/s"
    )


def _after_steps(*hooks):
    """One on_stepped hook calling those given (None: absent), in order."""
    hooks = [h for h in hooks if h is not None]
    if not hooks:
        return None

    def call(event, step):
        for hook in hooks:
            hook(event, step)

    return call


def _prepare(plan, stage_classes, args, where, topo, ckpt, device, precision, say, carried):
    """This rank's own checks and set-up: its --log-json, its checkpoint folder, its export
    and log, its stages and --init weights, their precision and optimizers. `where`: the
    rank and the pipeline GPU it runs."""
    rank, gpu = where
    if args.log_json and rank == 0:
        check_writable_file(args.log_json, "--log-json")
    if args.trace and rank == 0:
        check_writable_file(args.trace, "--trace")
    if args.save_every:
        _check_folder(ckpt.root)
        if not args.resume:
            ckpt.refuse_foreign()
    exporter = HFExporter(plan, args, ckpt, say) if args.save_hf else None
    runlog = RunLog(args.log_dir, rank, say=say) if args.log_dir and not carried else None
    runlog = carried.runlog if carried else runlog
    modules = build_stages(topo, stage_classes, gpu, device, precision.dtype)
    if args.init:
        load_init(modules, args.init, plan)
    mixed = MixedPrecision(precision, modules)  # after --init: the masters copy the weights
    mixed.say = say
    optimizers = {
        s: make_optimizer(args.optimizer, [t for _, t in mixed.trainable(s)], args.lr)
        for s in modules
    }
    torch.manual_seed(args.seed * 7919 + rank)  # the rank's own generator, repeats per run
    return modules, optimizers, mixed, exporter, runlog


def _agree_to_start(failure: Exception | None, rank: int, world: int) -> None:
    """Every rank learns whether every other could start; the first that could not is named."""
    said = None if failure is None else str(failure) or type(failure).__name__
    if world > 1:
        said = next(((r, w) for r, w in enumerate(_all_gather(said, world)) if w), None)
    elif said is not None:
        said = (rank, said)
    if failure is not None:
        raise failure
    if said is not None:
        raise PipelineConfigError(f"rank {said[0]} could not start: {said[1]}")


def _message_specs(topo: Topology):
    def spec_of(key):
        t = topo.transfers[key[1]]
        return t.shape, t.dtype

    return spec_of


def _fault(rank: int):
    """(step, mode) from FTPIPE_FAULT=rank:step:mode: stop after this rank's last S of step."""
    text = os.environ.get("FTPIPE_FAULT", "")
    if not text:
        return None
    r, step, mode = text.split(":")
    return (int(step), mode) if int(r) == rank else None


def _lr_changes(args, saved_steps, first: int) -> bool:
    """Does --steps (which the learning-rate decay depends on) change the rates from `first`?"""
    if not isinstance(saved_steps, int) or saved_steps == args.steps:
        return False
    rate = lambda k, steps: lr_at(k, args.lr, steps, args.warmup, args.decay)  # noqa: E731
    return any(rate(k, saved_steps) != rate(k, args.steps) for k in range(first, args.steps))


def _quiet(line: str) -> None:
    pass


def _check_folder(root: Path) -> None:
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise PipelineConfigError(
            f"cannot make the checkpoint folder {root}: {e.strerror}"
        ) from None
    check_writable_folder(root, f"checkpoints in {root}")


def _all_gather(value, world: int) -> list:
    """Every rank's `value` (a small picklable object), in rank order."""
    if world == 1:
        return [value]
    out = [None] * world
    try:
        dist.all_gather_object(out, value)
    except Exception as e:  # noqa: BLE001
        raise PeerFailure(f"a rank vanished while choosing a checkpoint ({e})") from e
    return out


def _barrier(world: int, what: str) -> None:
    if world > 1:
        try:
            dist.barrier()
        except Exception as e:  # noqa: BLE001
            raise PeerFailure(f"a rank never arrived while {what} ({e})") from e


def _first_replica(everyone: list[dict]) -> dict:
    return {k: v for e in everyone if e["replica"] == 0 for k, v in sorted(e["checksums"].items())}


def _replica_difference(everyone: list[dict]) -> float:
    first = _first_replica(everyone)
    return max(
        (
            abs(a - b)
            for e in everyone
            for k, v in e["checksums"].items()
            for a, b in zip(v, first.get(k, v))
        ),
        default=0.0,
    )


def _finish(args, plan, modules, progress, device, where, first, m, wall, mixed, segments):
    world, rank, replica = where
    mine = {
        "memory": peak_memory(device),
        "checksums": checksums(modules),
        "skipped_steps": mixed.skipped,
        "replica": replica,
    }
    everyone = [mine]
    if world > 1:
        everyone = [None] * world
        try:
            dist.all_gather_object(everyone, mine)
        except Exception as e:  # noqa: BLE001
            raise PeerFailure(f"a rank vanished at the end ({e})") from e
    summary = {
        "schedule": args.schedule or plan["schedule"],
        "steps": args.steps,
        "first_step": first,
        "micro_batches": m,
        "wall_s": wall,
        "losses": [progress.losses.get(k) for k in range(first, args.steps)],
        "samples_per_s": progress.samples_per_s(),
        "steady_samples_per_s": progress.steady_samples_per_s(),
        "memory_bytes": [e["memory"] for e in everyone],
        "dtype": args.dtype,
        "evals": [{"step": k, **v} for k, v in sorted(progress.evals.items())],
        "skipped_steps": [e["skipped_steps"] for e in everyone],  # per rank: the same
        "checksums": _first_replica(everyone),
        # Every replica holds the same weights after every step: the first replica's,
        # compared with each other's (0.0: identical).
        "replica_difference": _replica_difference(everyone),
        "freezes": getattr(args, "freeze_decisions", []),
        "segments": segments,  # one per plan the run trained on
    }
    if rank == 0:
        mem = ", ".join(f"rank {r} {human_bytes(b)}" for r, b in enumerate(summary["memory_bytes"]))
        progress.write(
            f"done: {args.steps - first} steps in {wall:.1f} s, "
            f"{summary['samples_per_s']:.1f} samples/s; peak memory {mem}"
        )
        if args.log_json:
            write_atomic(args.log_json, json.dumps(summary, indent=1))
    if world > 1:
        _barrier(world, "finishing")
        dist.destroy_process_group()
    return summary
