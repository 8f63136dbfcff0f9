"""`ftpipe_runtime.run(plan, stages, argv)`: train the pipeline on this rank (torchrun).

    torchrun --nproc_per_node 2 -m t5_tiny_pipeline --steps 20 --schedule gpipe
    RANK=0 WORLD_SIZE=2 python tests/runtime/runtime_toy.py plan.json \
        --init-method file:///tmp/x/store ...               # (and RANK=1 beside it)

Rank r builds only the stages on GPU r, executes its action list of the schedule, and
rank 0 logs the loss of every step (options: `options.py`). With data parallelism the plan
places `replicas` copies of the pipeline on the ranks (`ftpipe_runtime.train.replicas`): a rank
runs one GPU of one replica, reads that replica's share of every batch, and sums its
stages' gradients with the same GPU of the other replicas before each step. The actions are
made a step window at a time (`schedules.Timeline`), so starting takes as long for 100,000 steps as for
10. Whether a peer is gone is decided by its heartbeat (`liveness`), not by how long one
wait lasted: no heartbeat for --timeout, a rank that said it stopped, or no rank progressing
for --hang-timeout while one is busy. Every way a rank stops is one line on stderr, the
peers told, and an exit code: 1 for a failure (bad input, a lost peer, a failed write, an
unexpected error: --debug shows its traceback), 130 for Ctrl-C and 143 for SIGTERM (and on
the peers of an interrupted rank), 3 for FTPIPE_FAULT's exit (`os._exit`: a process group with a dead
member cannot be shut down cleanly). A rank that cannot start (a wrong `--init`, say) tells
the others when they meet, and they all stop naming it.
FTPIPE_FAULT=rank:step:exit|hang|raise|slow[:seconds] makes a rank exit, hang, raise an
unexpected error or stall after that step, for tests of exactly that.
"""

from __future__ import annotations

import logging
import math
import os
import sys
import time
import traceback
from dataclasses import replace
from pathlib import Path

import torch.distributed as dist

from ..atomic import remove_temporaries
from ..checkpoint import store as checkpoint
from ..checkpoint.saver import Saver
from ..data.sources import open_sources
from ..engine.assemble import load_checkpoint, make_executor, make_stepper
from ..engine.comm import Comm, init_distributed
from ..engine.dataflow import Dataflow
from ..engine.evaluate import listen_for_losses, splicer
from ..engine.trace import Tracer
from ..errors import PeerFailure, PipelineConfigError, WriteFailed
from ..freeze.elastic import Carried, Shrinks, load_carried
from ..freeze.mode import TrainingMode, segment_line, segment_row
from ..schedules import Timeline, resolve_schedule
from ..spec.plan import Plan, read_plan
from ..spec.topology import Topology
from ..train.precision import for_run, plan_in
from ..train.replicas import Shard
from . import liveness
from .config import RunConfig
from .context import Built, Connected, Prepared, Settled
from .liveness import INTERRUPTED, TERMINATED, die
from .logs import LOGGER, sayer, setup_logging
from .memory import memory_meter
from .options import parse_args
from .prepare import lr_changes, prepare_rank
from .ranks import Place, agree_to_start, all_gather, barrier, fault_of
from .report import Progress, Rates
from .signals import Terminated, catch_sigterm
from .summary import finish, gather_trace, save_hf

__all__ = ["run"]


def run(plan: Plan | dict | str | os.PathLike, stages: dict, argv: list[str] | None = None) -> dict:
    """Train this rank's stages; returns the run's summary (losses on rank 0).

    `plan` is the plan, its JSON object or the path of plan.json; each is checked (the one
    reader's checks, spec/plan.py) before anything runs.
    """
    rank = int(os.environ.get("RANK", 0))
    argv_plan = plan
    catch_sigterm()  # torchrun's stop: one line and 143, as Ctrl-C's 130
    try:
        # Before the arguments, whose defaults come from the plan. The run's modules read
        # its checked JSON object (typed reads there: issue 33).
        plan = _checked(plan).to_dict()
    except PipelineConfigError as e:
        raise SystemExit(f"ftpipe: {e}") from None
    config = parse_args(argv, plan, package=_package_of(stages))
    setup_logging(rank, config.loudness)
    try:
        # Freeze training on a package compiled with --freeze-training: segments, each on
        # its plan, the next one shorter (ftpipe_runtime.freeze.elastic).
        # --no-shrink: freeze, but stay on this plan (the shorter ones beside it unused).
        plain = not isinstance(argv_plan, (str, os.PathLike)) or config.no_shrink
        shrinks = None if plain else Shrinks.beside(Path(argv_plan))
        mode = TrainingMode.of(config, shrinks)
        carried = None
        while isinstance(got := _Run(plan, stages, config, rank, mode, carried).train(), Carried):
            carried, plan, stages = got, got.plan, got.stages
    except BaseException as e:  # noqa: BLE001 - every way out: one line, peers told, a code
        _stop(e, config.debug)
    liveness.on_failure("checkpoints", None)
    if (live := liveness.current()) is not None:
        live.close()
    return got


def _checked(plan) -> Plan:
    if isinstance(plan, Plan):
        return plan
    return Plan.from_dict(plan) if isinstance(plan, dict) else read_plan(plan)


def _stop(e: BaseException, debug: bool):
    """End this rank after `e` with one sentence and its exit code (README: exit codes): at
    once, the others told, where they watch this rank; else (before the ranks meet, where
    each finds the same bad input, or on one rank) a plain exit."""
    why, code = _sentence(e, debug)
    if liveness.current() is not None or dist.is_initialized():
        if debug:
            traceback.print_exception(e)
        die(why, code)
    liveness.tidy({int(os.environ.get("RANK", 0))})
    if debug or isinstance(e, SystemExit):
        raise e
    if code != 1:
        print(f"ftpipe: {why}", file=sys.stderr, flush=True)
        raise SystemExit(code) from None
    raise SystemExit(f"ftpipe: {why}") from None


def _sentence(e: BaseException, debug: bool) -> tuple[str, int]:
    if isinstance(e, Terminated):
        return TERMINATED
    if isinstance(e, KeyboardInterrupt):
        return INTERRUPTED
    if isinstance(e, PeerFailure):
        return str(e), e.code
    if isinstance(e, (PipelineConfigError, WriteFailed)):
        return str(e), 1
    if isinstance(e, SystemExit):
        return (e.code, 1) if isinstance(e.code, str) else ("stopped", e.code or 0)
    where = "" if debug else " (--debug shows where)"
    return f"unexpected error: {type(e).__name__}: {liveness.short(e)}{where}", 1


class _Run:
    """One plan's part of the run on this rank (the whole run, without freeze training),
    in phases: settle what every rank finds alike, start (this rank's own set-up, then the
    meeting), connect, build the executor, execute, and end (the summary, or what the next
    plan carries on with). Each phase returns its typed record (`context`) and the later
    phases take it: nothing is read before the phase that makes it has run."""

    def __init__(
        self, plan, stage_classes, config: RunConfig, rank: int, mode: TrainingMode, carried
    ):
        # What `settle` starts from (its `config` before --epochs is counted on the data).
        self.plan, self.stage_classes, self.config = plan, stage_classes, config
        self.mode, self.carried = mode, carried
        self.place = Place.of(plan, config.device, rank)
        self.say = sayer(logging.getLogger(LOGGER)) if rank == 0 else _quiet

    def train(self):
        """The run's summary, or what it hands to the next, shorter plan (`Carried`)."""
        settled, first, timeline = self.settle()
        prepared, first, manifest, timeline = self.start(settled, first, timeline)
        connected = self.connect(settled, first=first, manifest=manifest, timeline=timeline)
        built = self.build(settled, prepared, connected)
        wall = self.execute(settled, connected, built)
        return self.end(settled, prepared, connected, built, wall)

    def settle(self) -> tuple[Settled, int, Timeline]:
        """Everything that can be refused is refused before any rank waits for another:
        first what every rank finds alike (the data, which settles --steps under --epochs;
        the schedule's lists on this plan: a CSV file that skips or deadlocks), then (in
        `start`) what is this rank's own, which the others hear of when they meet. Returns
        the settled record, the step this segment starts from and its actions (both moved
        by --resume in `start`)."""
        plan, config, carried, place = self.plan, self.config, self.carried, self.place
        reps = place.reps
        name = config.schedule or plan["schedule"]
        sched = resolve_schedule(name)
        if not plan.get("recompute", True) and sched.can_keep_activations:
            sched = sched.without_recompute()  # the planner chose to keep activations
        m = config.micro_batches or sched.micro_batches or int(plan["micro_batches"])
        m = carried.micro_batches if carried else m
        precision = for_run(plan, config.dtype, sched)
        topo = Topology(plan_in(plan, precision))  # messages in compute dtype
        sources = open_sources(plan, config, m, self.say)
        config = config.with_steps(sources.steps)  # --epochs counted on the data
        first = carried.first if carried else 0
        stop = self.mode.segment_end(first, config.steps, topo.world)
        self.mode.check(sched, name, shrinking=stop < config.steps, config=config,
                        evaluating=sources.eval is not None)  # fmt: skip
        timeline = Timeline(sched, topo.stage_infos(), m, stop, drain_every=config.save_every)
        timeline.check(topo.stage_graph(), _every_step(topo, m, sources.eval))
        if place.replica != reps.where(0)[0]:  # the replicas hold the same weights: rank 0's
            sources = replace(sources, eval=None)  # alone evaluates
        root = Path(config.checkpoint_dir or checkpoint.default_dir(plan))
        root = root / carried.name if carried else root  # each plan's checkpoints its own
        identity = checkpoint.run_identity(plan, config, name, m)
        ckpt = checkpoint.Checkpoints(
            root, place.rank, place.world, identity, config.keep_checkpoints, self.say
        )
        settled = Settled(
            plan=plan, stage_classes=self.stage_classes, config=config, mode=self.mode,
            carried=carried, place=place, say=self.say, schedule_name=name, schedule=sched,
            micro_batches=m, precision=precision, topo=topo, sources=sources,
            data=Shard(sources.train, place.replica, reps.count, m), stop=stop, root=root,
            ckpt=ckpt,
        )  # fmt: skip
        return settled, first, timeline

    def start(
        self, settled: Settled, first: int, timeline: Timeline
    ) -> tuple[Prepared, int, dict | None, Timeline]:
        """This rank's own set-up, then the meeting (where a rank that failed is named), then
        the step to start from (--resume): (its parts, that step, the resumed checkpoint's
        manifest, the actions from that step)."""
        config, place, ckpt, root = settled.config, settled.place, settled.ckpt, settled.root
        # Beating from the start: a rank that loads its weights for minutes is waited for.
        live = liveness.start(
            place.rank,
            place.world,
            config.init_method,
            timeout_s=config.timeout,
            hang_s=config.hang_timeout,
        )
        failure = prepared = None
        try:
            prepared = prepare_rank(settled)
        except Exception as e:  # noqa: BLE001 - told to the other ranks first, then raised
            failure = e
        if live is not None and not dist.is_initialized():
            live.meet()
            backstop = liveness.backstop(config.hang_timeout)
            init_distributed(place.rank, place.world, place.device.type, live.pg_store, backstop)
        agree_to_start(failure, place.rank, place.world)  # raises unless every rank prepared
        manifest = None
        if config.resume:
            first, manifest = ckpt.choose(lambda v: all_gather(v, place.world))
        if first >= config.steps:
            raise PipelineConfigError(f"the checkpoint is at step {first}; ask for more --steps")
        if manifest and lr_changes(config, manifest.get("steps"), first):
            settled.say(
                f"ftpipe: note: the checkpoint's run had --steps {manifest['steps']}, this "
                f"one {config.steps}; the learning-rate schedule changes from step {first}"
            )
        if place.rank == 0 and (config.save_every or config.resume):
            remove_temporaries(root)  # of a killed save; nobody saves before the barrier
        if config.save_every:  # the run's id in its manifests, and --overwrite-checkpoints
            agree = lambda v: all_gather(v, place.world, "naming the run")  # noqa: E731
            ckpt.start(manifest, agree, replace=config.overwrite_checkpoints)
            liveness.on_failure("checkpoints", ckpt.leave)
        if first:  # the pipeline fills again from the checkpoint's step
            timeline = timeline.resumed(first)
            timeline.check(
                settled.topo.stage_graph(),
                _every_step(settled.topo, settled.micro_batches, settled.sources.eval),
            )
        return prepared, first, manifest, timeline

    def connect(
        self, settled: Settled, *, first: int, manifest: dict | None, timeline: Timeline
    ) -> Connected:
        """The dataflow, the messages and the process groups: the gradient norm across a
        pipeline's ranks when a synchronous step clips (fp16's overflow check rides on it:
        the norm is computed then even without clipping), and each GPU's gradients with its
        replicas."""
        config, topo, place, m = settled.config, settled.topo, settled.place, settled.micro_batches
        reps = place.reps
        rounds = dict(data=settled.sources.eval, steps=config.steps, every=config.eval_every)
        flow = Dataflow(topo, timeline, splicer(topo, m, first=first, **rounds))
        backstop = liveness.backstop(config.hang_timeout).total_seconds()
        comm = Comm(
            place.gpu, topo.world, place.device, backstop, flow, _message_specs(topo),
            reps, place.replica, ahead_bytes=int(config.post_ahead * 2**20),
        )  # fmt: skip
        freezing = settled.mode.freezing
        collective = settled.schedule.synchronous and (
            config.clip or settled.precision.loss_scaling or freezing
        )
        collective_sets = [tuple(range(topo.world))] if collective else []
        dp_sets = [reps.stage_group(g) for g in range(topo.world)] if reps.count > 1 else []
        comm.make_groups(collective_sets, topo.rank_of[topo.loss_stage], dp_sets)
        return Connected(first=first, manifest=manifest, timeline=timeline, flow=flow, comm=comm)

    def build(self, settled: Settled, prepared: Prepared, connected: Connected) -> Built:
        """Progress, freezing, checkpoints, the optimizer steps and the executor; then the
        resumed run's weights, state and kept weight versions."""
        config, place, carried = settled.config, settled.place, settled.carried
        mixed, first = prepared.mixed, connected.first
        micro_batch = next(iter(settled.plan["model"]["inputs"].values()))[0][0]
        samples = place.reps.count * settled.micro_batches * micro_batch
        # The step's gradient norm is in hand where it clips over the whole pipeline (or
        # checks fp16 overflow): the log shows it there, and computes none of its own.
        norms = settled.schedule.synchronous and bool(config.clip or settled.precision.loss_scaling)
        progress = Progress(
            place.rank == 0, config.steps, first, samples, config.log_every,
            rates=_rates(settled),
            memory=lambda: memory_meter(str(place.device)).peaks()["allocated"],
            norms=norms and place.rank == 0, bar=not config.quiet,
        )  # fmt: skip
        progress.log, progress.lr_of = prepared.runlog, config.lr_at
        if carried:
            progress.losses.update(carried.losses)
        if config.resume:
            root = settled.root
            where = f"step {first} of {root}" if first else f"step 0: no checkpoint in {root}"
            _note(place, progress)(f"resuming from {where}")
        freezer = settled.mode.freezer(
            settled.plan, prepared.modules, prepared.optimizers, mixed, connected.comm,
            resume=config.resume, say=progress.write, runlog=prepared.runlog,
        )  # fmt: skip
        if carried:  # the same layers frozen, then the weights and state handed over loaded
            freezer.start_frozen(carried.frozen)
            load_carried(carried, prepared.modules, prepared.optimizers, mixed)
        saver = Saver(
            settled.ckpt, config.save_every, config.steps, settled.micro_batches,
            stages=place.replica == 0,
        )  # fmt: skip
        saver.modules, saver.optimizers = prepared.modules, prepared.optimizers
        saver.precision = mixed
        stepper = make_stepper(settled, prepared, comm=connected.comm, freezer=freezer, saver=saver)
        if norms and place.rank == 0:
            stepper.on_norm = progress.grad_norm
        executor, on_eval = make_executor(
            settled, prepared, connected, stepper=stepper, progress=progress, freezer=freezer
        )
        saver.versions, saver.drained = executor.kept_versions, connected.timeline.drains
        if first and not carried:
            load_checkpoint(
                settled, prepared, first=first, manifest=connected.manifest, executor=executor
            )
        if not carried:
            _announce(settled, prepared, progress)
        return Built(
            progress=progress, freezer=freezer, saver=saver, stepper=stepper, executor=executor,
            on_eval=on_eval, samples=samples,
        )  # fmt: skip

    def execute(self, settled: Settled, connected: Connected, built: Built) -> float:
        """This rank's actions, timed (seconds); rank 0 hears the loss stage's losses."""
        config, place = settled.config, settled.place
        comm, executor = connected.comm, built.executor
        fault = fault_of(place.rank)

        def after(i, item):
            if fault and item.ends_step == fault[0]:
                _, mode, seconds = fault
                if mode == "slow":  # busy, alive: its peers wait on
                    time.sleep(seconds)
                    return
                if mode == "raise":  # an error nobody foresaw
                    raise RuntimeError("FTPIPE_FAULT raises")
                comm.finish()
                if mode == "hang":  # alive (its heartbeat goes on) but never progressing
                    time.sleep(3600)
                die("FTPIPE_FAULT stops this rank", 3)

        barrier(place.world, "starting")
        executor.tracer = Tracer(comm, keep=bool(config.trace))
        executor.tracer.start()
        listener = None
        if place.rank == 0:
            listener = listen_for_losses(
                settled.topo, connected.flow, comm, micro_batches=settled.micro_batches,
                reps=place.reps, executor=executor, on_loss=built.progress.loss,
                on_eval=built.on_eval, evals=settled.sources.eval, steps=config.steps,
            )  # fmt: skip
        start = time.perf_counter()
        executor.run(connected.flow.actions(place.gpu), after)
        if listener is not None:
            loss = ", ".join(map(str, sorted(comm.loss_groups)))
            with liveness.waiting(f"waiting for the losses of the loss stage (rank {loss})"):
                listener.join()
            if comm.listener_error:
                raise liveness.failure(
                    "rank 0 gave up waiting for the losses of the loss stage", comm.listener_error
                )
        comm.finish()
        return time.perf_counter() - start

    def end(
        self, settled: Settled, prepared: Prepared, connected: Connected, built: Built,
        wall: float,
    ):  # fmt: skip
        """The next plan's start (`Carried`) at a segment's end, else the run's summary."""
        carried, place, progress = settled.carried, settled.place, built.progress
        first = connected.first
        note = _note(place, progress)
        done = carried.segments if carried else []
        segments = [
            *done,
            segment_row(first, settled.stop, place.reps, built.samples, wall, progress.times),
        ]
        if settled.stop < settled.config.steps:
            progress.close()
            note(segment_line(segments[-1]))
            return settled.mode.switch(
                settled, prepared, freezer=built.freezer, first=first, losses=progress.losses,
                note=note, end=settled.stop, segments=segments,
            )  # fmt: skip
        if carried:
            note(segment_line(segments[-1]))
        wall = sum(row["wall_s"] for row in segments)  # of every plan's steps
        if settled.config.trace:
            gather_trace(settled, comm=connected.comm, tracer=built.executor.tracer, first=first)
        progress.close()
        if prepared.exporter is not None:
            save_hf(settled, prepared)
        if prepared.runlog is not None:
            prepared.runlog.close()
        start = carried.start if carried else first
        return finish(settled, prepared, built, first=start, wall=wall, segments=segments)


def _every_step(topo: Topology, m: int, evals):
    """Evaluation rounds after every step: the most there can be (`Timeline.check`)."""
    return lambda n: splicer(topo, m, evals, steps=n, first=0, every=1)


def _note(place: Place, progress: Progress):
    """Lines from rank 0 beside its progress bar (the other ranks': silent)."""
    return progress.write if place.rank == 0 else _quiet


def _rates(settled: Settled) -> Rates:
    """Tokens and model FLOPs of a step, and the peak FLOP/s of every GPU of the run (on
    a GPU: the compiled hardware's, in the run's dtype; MFU against it)."""
    model, place = settled.plan["model"], settled.place
    inputs = model.get("inputs") or {}
    shape = (inputs.get("input_ids") or next(iter(inputs.values()), [[0]]))[0]
    micro_batches = settled.micro_batches * place.reps.count  # of a step, every replica's
    tokens = micro_batches * math.prod(shape)
    flops = float(model.get("flops_per_micro_batch") or 0.0) * micro_batches
    peaks = model.get("peak_flops") or {}
    dtype = str(settled.precision.dtype).removeprefix("torch.")
    if dtype == "float32" and settled.config.tf32 and peaks.get("tf32"):
        dtype = "tf32"
    peak = float(peaks.get(dtype) or 0.0) * place.world
    return Rates(tokens, flops, peak if place.device.type == "cuda" else 0.0)


def _announce(settled: Settled, prepared: Prepared, progress: Progress) -> None:
    """Rank 0 says once where the run's outputs go, and what it trains on."""
    if settled.place.rank != 0:
        return
    config, log, root = settled.config, progress.logger, settled.root
    if config.save_every:
        log.info("checkpoints: %s, every %d steps", root, config.save_every)
    else:
        log.info("checkpoints: none (--save-every N saves to %s)", root)
    places = prepared.runlog.where() if prepared.runlog is not None else []
    log.info("logs: %s", "; ".join(places) if places else "these lines only (--log-dir, "
             "--log-jsonl, --tensorboard, --wandb write more)")  # fmt: skip
    if config.log_json:
        log.info("summary: %s", config.log_json)
    if config.save_hf:
        log.info("export: %s (HuggingFace folder) at the end", config.save_hf)
    if config.data is None or config.data == "synthetic":
        log.warning(
            "training on synthetic tokens (random ids of the compiled shapes): pass --data "
            "FILE to fine-tune on your data"
        )
    elif config.data == "copy":
        log.info("training on the synthetic copy task (counting sequences)")
    rates = progress.rates
    if rates.peak_flops:
        log.debug("MFU against %.4g TFLOP/s in all (%s's peak)", rates.peak_flops / 1e12,
                  settled.plan["model"].get("hardware"))  # fmt: skip
    log.debug("options: %s", config.to_dict())


def _message_specs(topo: Topology):
    def spec_of(key):
        t = topo.transfers[key[1]]
        return t.shape, t.dtype

    return spec_of


def _package_of(stages: dict) -> str:
    """The generated package's name, for --help (its stages live in `<package>.stages`)."""
    first = next(iter(stages.values()), None)
    return (getattr(first, "__module__", "") or "").rpartition(".")[0] or "<package>"


def _quiet(line: str) -> None:
    pass
