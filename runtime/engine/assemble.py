"""The executor and what it calls, wired from the parts of a run (`run._Run`): the optimizer
steps with their hooks, the handlers of evaluation and of the replicas' gradient sums, and a
resumed run's state loaded into them.

    stepper = make_stepper(run); executor, on_eval = make_executor(run); load_checkpoint(run)
"""

from __future__ import annotations

from ..job.cpu_allocator import release_free_heap
from ..job.report import memory_meter
from ..train.replicas import GradSync
from ..train.stepping import Stepper
from .act_offload import of_run
from .evaluate import Evaluator, reporter
from .executor import Executor

__all__ = ["after_steps", "load_checkpoint", "make_executor", "make_stepper"]


def make_stepper(run) -> Stepper:
    """The optimizer steps, with the hooks after each: the CPU heap handed back, checkpoint,
    export, memory log, freeze."""
    config, place, freezer, runlog = run.config, run.place, run.freezer, run.runlog
    exporter = run.exporter if place.rank == 0 else None
    meter = memory_meter(str(place.device))
    on_stepped = after_steps(
        # glibc keeps what a step freed (cpu_allocator.keep_heap), and tensors that outlive a
        # step (weight versions, gradients, receive buffers) then land past the holes: given
        # back once a step, the resident set follows the live tensors instead of growing.
        (lambda ev, k: release_free_heap()) if place.device.type == "cpu" else None,
        run.saver if config.save_every else None,
        (lambda ev, k: exporter.after_checkpoint()) if exporter else None,
        (lambda ev, k: runlog.memory(k + 1, meter.peaks())) if runlog else None,
        freezer.after_step if freezer else None,
    )
    stepper = Stepper(
        run.topo, place.gpu, run.modules, run.optimizers, run.comm,
        lr_of=run.lr_of, clip=config.clip, on_stepped=on_stepped, precision=run.mixed,
    )  # fmt: skip
    stepper.on_grads = freezer.measure if freezer else None
    return stepper


def make_executor(run):
    """(the executor with its handlers and hooks, the evaluation results' handler)."""
    config, place, topo, progress = run.config, run.place, run.topo, run.progress
    executor = Executor(
        topo, place.gpu, run.modules, run.flow, run.comm,
        data=run.data, stepper=run.stepper, micro_batches=run.m, device=place.device,
        on_loss=progress.loss, seed=config.seed, precision=run.mixed,
    )  # fmt: skip
    executor.offload = of_run(run, executor.forward_only)  # --offload-activations, the plan's
    on_eval = reporter(run.plan, config.steps, run.first, config.eval_every, progress)
    if run.sources.eval is not None:  # its results tagged after every step's loss
        evaluator = Evaluator(topo, place.gpu, run.modules, run.comm, run.sources.eval,
                              place.device, config.steps, on_eval,
                              synchronous=run.sched.synchronous)  # fmt: skip
        executor.handlers["E"] = evaluator.forward
    if place.reps.count > 1:
        sync = GradSync(run.mixed, run.comm, place.reps.stage_group(place.gpu), run.m)
        executor.grad_sync = run.stepper.grad_sync = sync
        if run.freezer:
            run.freezer.grad_sync = sync
    return executor, on_eval


def load_checkpoint(run) -> None:
    """A resumed run's weights, optimizer state, RNG, loss scale and kept weight versions."""
    first, ckpt, mixed = run.first, run.ckpt, run.mixed
    for s, mod in run.modules.items():
        load = lambda t, s=s, mod=mod: mixed.load(s, mod, t)  # noqa: E731
        state_device = "cpu" if mixed.offloads(s) else None  # offloaded: straight to the host
        ckpt.load_stage(first, s, mod, run.optimizers[s], run.place.device, load, state_device)
    ckpt.load_rank(first)
    mixed.restore((run.manifest or {}).get("state", {}))
    run.executor.restore_versions(ckpt.load_versions(first))


def after_steps(*hooks):
    """One on_stepped hook calling those given (None: absent), in order."""
    hooks = [h for h in hooks if h is not None]
    if not hooks:
        return None

    def call(event, step):
        for hook in hooks:
            hook(event, step)

    return call
