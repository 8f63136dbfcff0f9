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
from .liveness import INTERRUPTED, TERMINATED, die
from .logs import LOGGER, sayer, setup_logging
from .options import parse_args
from .prepare import lr_changes, prepare_rank
from .ranks import Place, agree_to_start, all_gather, barrier, fault_of
from .report import Progress, Rates, memory_meter
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
    plan carries on with). The phases share what they make as attributes."""

    def __init__(
        self, plan, stage_classes, config: RunConfig, rank: int, mode: TrainingMode, carried
    ):
        self.plan, self.stage_classes, self.config = plan, stage_classes, config
        self.mode, self.carried = mode, carried
        self.place = Place.of(plan, config.device, rank)
        self.say = sayer(logging.getLogger(LOGGER)) if rank == 0 else _quiet

    def note(self, line: str) -> None:
        """A line from rank 0 beside its progress bar."""
        if self.place.rank == 0:
            self.progress.write(line)

    def train(self):
        """The run's summary, or what it hands to the next, shorter plan (`Carried`)."""
        self.settle()
        self.start()
        self.connect()
        self.build()
        wall = self.execute()
        return self.end(wall)

    def settle(self) -> None:
        """Everything that can be refused is refused before any rank waits for another:
        first what every rank finds alike (the data, which settles --steps under --epochs;
        the schedule's lists on this plan: a CSV file that skips or deadlocks), then (in
        `start`) what is this rank's own, which the others hear of when they meet."""
        plan, config, carried, reps = self.plan, self.config, self.carried, self.place.reps
        self.name = config.schedule or plan["schedule"]
        sched = resolve_schedule(self.name)
        if not plan.get("recompute", True) and sched.can_keep_activations:
            sched = sched.without_recompute()  # the planner chose to keep activations
        m = config.micro_batches or sched.micro_batches or int(plan["micro_batches"])
        m = carried.micro_batches if carried else m
        self.sched, self.m = sched, m
        self.precision = for_run(plan, config.dtype, sched)
        self.topo = topo = Topology(plan_in(plan, self.precision))  # messages in compute dtype
        self.sources = sources = open_sources(plan, config, m, self.say)
        self.config = config = config.with_steps(sources.steps)  # --epochs counted on the data
        if reps.count > 1 and (sources.eval is not None or config.save_hf):
            raise PipelineConfigError(
                "evaluation and --save-hf do not run with data-parallel replicas yet; leave them "
                "out, or compile the package with --replicas 1"
            )
        self.data = Shard(sources.train, self.place.replica, reps.count, m)
        self.first = carried.first if carried else 0
        self.stop = self.mode.segment_end(self.first, config.steps, topo.world)
        self.mode.check(sched, self.name, shrinking=self.stop < config.steps, config=config,
                        evaluating=sources.eval is not None)  # fmt: skip
        self.timeline = Timeline(
            sched, topo.stage_infos(), m, self.stop, drain_every=config.save_every
        )
        self.timeline.check(topo.stage_graph(), self.every_step)
        root = Path(config.checkpoint_dir or checkpoint.default_dir(plan))
        self.root = root / carried.name if carried else root  # each plan's checkpoints its own
        identity = checkpoint.run_identity(plan, config, self.name, m)
        self.ckpt = checkpoint.Checkpoints(
            self.root,
            self.place.rank,
            self.place.world,
            identity,
            config.keep_checkpoints,
            self.say,
        )

    def every_step(self, n: int):
        """Evaluation rounds after every step: the most there can be (`Timeline.check`)."""
        return splicer(self.topo, self.m, self.sources.eval, steps=n, first=0, every=1)

    def start(self) -> None:
        """This rank's own set-up, then the meeting (where a rank that failed is named), then
        the step to start from (--resume)."""
        config, place = self.config, self.place
        # Beating from the start: a rank that loads its weights for minutes is waited for.
        live = liveness.start(
            place.rank,
            place.world,
            config.init_method,
            timeout_s=config.timeout,
            hang_s=config.hang_timeout,
        )
        failure = None
        try:
            made = prepare_rank(self, place.rank, place.gpu)
            self.modules, self.optimizers, self.mixed, self.exporter, self.runlog = made
        except Exception as e:  # noqa: BLE001 - told to the other ranks first, then raised
            failure = e
        if live is not None and not dist.is_initialized():
            live.meet()
            backstop = liveness.backstop(config.hang_timeout)
            init_distributed(place.rank, place.world, place.device.type, live.pg_store, backstop)
        agree_to_start(failure, place.rank, place.world)
        self.manifest = None
        if config.resume:
            self.first, self.manifest = self.ckpt.choose(lambda v: all_gather(v, place.world))
        first = self.first
        if first >= config.steps:
            raise PipelineConfigError(f"the checkpoint is at step {first}; ask for more --steps")
        if self.manifest and lr_changes(config, self.manifest.get("steps"), first):
            self.say(
                f"ftpipe: note: the checkpoint's run had --steps {self.manifest['steps']}, this "
                f"one {config.steps}; the learning-rate schedule changes from step {first}"
            )
        if place.rank == 0 and (config.save_every or config.resume):
            remove_temporaries(self.root)  # of a killed save; nobody saves before the barrier
        if config.save_every:  # the run's id in its manifests, and --overwrite-checkpoints
            agree = lambda v: all_gather(v, place.world, "naming the run")  # noqa: E731
            self.ckpt.start(self.manifest, agree, replace=config.overwrite_checkpoints)
        if first:  # the pipeline fills again from the checkpoint's step
            self.timeline = self.timeline.resumed(first)
            self.timeline.check(self.topo.stage_graph(), self.every_step)

    def connect(self) -> None:
        """The dataflow, the messages and the process groups: the gradient norm across a
        pipeline's ranks when a synchronous step clips (fp16's overflow check rides on it:
        the norm is computed then even without clipping), and each GPU's gradients with its
        replicas."""
        config, topo, place, reps = self.config, self.topo, self.place, self.place.reps
        rounds = dict(data=self.sources.eval, steps=config.steps, every=config.eval_every)
        self.flow = Dataflow(topo, self.timeline, splicer(topo, self.m, first=self.first, **rounds))
        backstop = liveness.backstop(config.hang_timeout).total_seconds()
        self.comm = Comm(
            place.gpu, topo.world, place.device, backstop, self.flow, _message_specs(topo),
            reps, place.replica, ahead_bytes=int(config.post_ahead * 2**20),
        )  # fmt: skip
        freezing = self.mode.freezing
        collective = self.sched.synchronous and (
            config.clip or self.precision.loss_scaling or freezing
        )
        collective_sets = [tuple(range(topo.world))] if collective else []
        dp_sets = [reps.stage_group(g) for g in range(topo.world)] if reps.count > 1 else []
        self.loss_rank = topo.rank_of[topo.loss_stage]
        self.comm.make_groups(collective_sets, self.loss_rank, dp_sets)

    def build(self) -> None:
        """Progress, freezing, checkpoints, the optimizer steps and the executor; then the
        resumed run's weights, state and kept weight versions."""
        config, place, carried, mixed = self.config, self.place, self.carried, self.mixed
        micro_batch = next(iter(self.plan["model"]["inputs"].values()))[0][0]
        self.samples = place.reps.count * self.m * micro_batch
        # The step's gradient norm is in hand where it clips over the whole pipeline (or
        # checks fp16 overflow): the log shows it there, and computes none of its own.
        norms = self.sched.synchronous and bool(config.clip or self.precision.loss_scaling)
        self.progress = progress = Progress(
            place.rank == 0, config.steps, self.first, self.samples, config.log_every,
            rates=self.rates(), memory=lambda: memory_meter(str(place.device)).peaks()["allocated"],
            norms=norms and place.rank == 0, bar=not config.quiet,
        )  # fmt: skip
        progress.log, progress.lr_of = self.runlog, self.lr_of
        if carried:
            progress.losses.update(carried.losses)
        if config.resume:
            root = self.root
            where = (
                f"step {self.first} of {root}" if self.first else f"step 0: no checkpoint in {root}"
            )
            self.note(f"resuming from {where}")
        self.freezer = freezer = self.mode.freezer(
            self.plan, self.modules, self.optimizers, mixed, self.comm,
            resume=config.resume, say=progress.write, runlog=self.runlog,
        )  # fmt: skip
        if carried:  # the same layers frozen, then the weights and state handed over loaded
            freezer.start_frozen(carried.frozen)
            load_carried(carried, self.modules, self.optimizers, mixed)
        self.saver = saver = Saver(
            self.ckpt, config.save_every, config.steps, self.m, stages=place.replica == 0
        )
        saver.modules, saver.optimizers, saver.precision = self.modules, self.optimizers, mixed
        self.stepper = make_stepper(self)
        if norms and place.rank == 0:
            self.stepper.on_norm = progress.grad_norm
        self.executor, self.on_eval = make_executor(self)
        saver.versions, saver.drained = self.executor.kept_versions, self.timeline.drains
        if self.first and not carried:
            load_checkpoint(self)
        if not carried:
            self.announce()

    def rates(self) -> Rates:
        """Tokens and model FLOPs of a step, and the peak FLOP/s of every GPU of the run (on
        a GPU: the compiled hardware's, in the run's dtype; MFU against it)."""
        model, place = self.plan["model"], self.place
        inputs = model.get("inputs") or {}
        shape = (inputs.get("input_ids") or next(iter(inputs.values()), [[0]]))[0]
        micro_batches = self.m * place.reps.count  # of a step, every replica's
        tokens = micro_batches * math.prod(shape)
        flops = float(model.get("flops_per_micro_batch") or 0.0) * micro_batches
        peaks = model.get("peak_flops") or {}
        dtype = str(self.precision.dtype).removeprefix("torch.")
        if dtype == "float32" and self.config.tf32 and peaks.get("tf32"):
            dtype = "tf32"
        peak = float(peaks.get(dtype) or 0.0) * place.world
        return Rates(tokens, flops, peak if place.device.type == "cuda" else 0.0)

    def announce(self) -> None:
        """Rank 0 says once where the run's outputs go, and what it trains on."""
        if self.place.rank != 0:
            return
        config, log = self.config, self.progress.logger
        if config.save_every:
            log.info("checkpoints: %s, every %d steps", self.root, config.save_every)
        else:
            log.info("checkpoints: none (--save-every N saves to %s)", self.root)
        places = self.runlog.where() if self.runlog is not None else []
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
        rates = self.progress.rates
        if rates.peak_flops:
            log.debug("MFU against %.4g TFLOP/s in all (%s's peak)", rates.peak_flops / 1e12,
                      self.plan["model"].get("hardware"))  # fmt: skip
        log.debug("options: %s", config.to_dict())

    def lr_of(self, k: int) -> float:
        return self.config.lr_at(k)

    def execute(self) -> float:
        """This rank's actions, timed (seconds); rank 0 hears the loss stage's losses."""
        config, place, comm = self.config, self.place, self.comm
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
        self.executor.tracer = self.tracer = Tracer(comm, keep=bool(config.trace))
        self.tracer.start()
        listener = listen_for_losses(self) if place.rank == 0 else None
        start = time.perf_counter()
        self.executor.run(self.flow.actions(place.gpu), after)
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

    def end(self, wall: float):
        """The next plan's start (`Carried`) at a segment's end, else the run's summary."""
        carried, place, progress = self.carried, self.place, self.progress
        done = carried.segments if carried else []
        segments = [
            *done,
            segment_row(self.first, self.stop, place.reps, self.samples, wall, progress.times),
        ]
        if self.stop < self.config.steps:
            progress.close()
            self.note(segment_line(segments[-1]))
            return self.mode.switch(self, self.stop, segments)
        if carried:
            self.note(segment_line(segments[-1]))
        wall = sum(row["wall_s"] for row in segments)  # of every plan's steps
        if self.config.trace:
            gather_trace(self, self.tracer, self.first)
        progress.close()
        if self.exporter is not None:
            save_hf(self)
        if self.runlog is not None:
            self.runlog.close()
        return finish(self, carried.start if carried else self.first, wall, segments)


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
