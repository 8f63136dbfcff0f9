"""The executor and what it calls, wired from the parts of a run (`job.context`): the
optimizer steps with their hooks, the handlers of evaluation and of the replicas' gradient
sums, and a resumed run's state loaded into them.

    stepper = make_stepper(settled, prepared, comm=comm, freezer=freezer, saver=saver)
    executor, on_eval = make_executor(settled, prepared, connected, stepper=stepper, ...)
    load_checkpoint(settled, prepared, first=first, manifest=manifest, executor=executor)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from ..job.cpu_allocator import release_free_heap
from ..job.memory import memory_meter
from ..train.replicas import GradSync
from ..train.stepping import Stepper
from .act_offload import of_run
from .evaluate import Evaluator, reporter
from .executor import Executor

if TYPE_CHECKING:
    from ..checkpoint.saver import Saver
    from ..freeze.layers import FreezeTraining
    from ..job.context import Connected, Prepared, Settled
    from ..job.report import Progress
    from .comm import Comm

__all__ = ["after_steps", "load_checkpoint", "make_executor", "make_stepper"]


def make_stepper(
    settled: Settled, prepared: Prepared, *, comm: Comm, freezer: FreezeTraining | None,
    saver: Saver,
) -> Stepper:  # fmt: skip
    """The optimizer steps, with the hooks after each: the CPU heap handed back, checkpoint,
    export, memory log, freeze."""
    config, place, runlog = settled.config, settled.place, prepared.runlog
    exporter = prepared.exporter if place.rank == 0 else None
    meter = memory_meter(str(place.device))
    on_stepped = after_steps(
        # glibc keeps what a step freed (cpu_allocator.keep_heap), and tensors that outlive a
        # step (weight versions, gradients, receive buffers) then land past the holes: given
        # back once a step, the resident set follows the live tensors instead of growing.
        (lambda ev, k: release_free_heap()) if place.device.type == "cpu" else None,
        saver if config.save_every else None,
        (lambda ev, k: exporter.after_checkpoint()) if exporter else None,
        (lambda ev, k: runlog.memory(k + 1, meter.peaks())) if runlog else None,
        freezer.after_step if freezer else None,
    )
    stepper = Stepper(
        settled.topo, place.gpu, prepared.modules, prepared.optimizers, comm,
        lr_of=config.lr_at, clip=config.clip, on_stepped=on_stepped, precision=prepared.mixed,
    )  # fmt: skip
    stepper.on_grads = freezer.measure if freezer else None
    return stepper


def make_executor(
    settled: Settled, prepared: Prepared, connected: Connected, *, stepper: Stepper,
    progress: Progress, freezer: FreezeTraining | None,
) -> tuple[Executor, Callable]:  # fmt: skip
    """(the executor with its handlers and hooks, the evaluation results' handler)."""
    config, place, topo, m = settled.config, settled.place, settled.topo, settled.micro_batches
    modules, mixed, comm = prepared.modules, prepared.mixed, connected.comm
    executor = Executor(
        topo, place.gpu, modules, connected.flow, comm,
        data=settled.data, stepper=stepper, micro_batches=m, device=place.device,
        on_loss=progress.loss, seed=config.seed, precision=mixed,
    )  # fmt: skip
    executor.offload = of_run(  # --offload-activations, the plan's
        config, topo, stages=modules, device=place.device, forward_only=executor.forward_only
    )
    on_eval = reporter(settled.plan, config.steps, connected.first, config.eval_every, progress)
    evals = settled.sources.eval
    if evals is not None:  # its results tagged after every step's loss
        evaluator = Evaluator(topo, place.gpu, modules, comm, evals, place.device, config.steps,
                              on_eval, synchronous=settled.schedule.synchronous,
                              flow=connected.flow, training=executor.acts)  # fmt: skip
        executor.handlers["E"] = evaluator.forward
    if place.reps.count > 1:
        sync = GradSync(mixed, comm, place.reps.stage_group(place.gpu), m)
        executor.grad_sync = stepper.grad_sync = sync
        if freezer:
            freezer.grad_sync = sync
    return executor, on_eval


def load_checkpoint(
    settled: Settled, prepared: Prepared, *, first: int, manifest: dict | None, executor: Executor
) -> None:
    """A resumed run's weights, optimizer state, RNG, loss scale and kept weight versions."""
    ckpt, mixed = settled.ckpt, prepared.mixed
    for s, mod in prepared.modules.items():
        load = lambda t, s=s, mod=mod: mixed.load(s, mod, t)  # noqa: E731
        state_device = "cpu" if mixed.offloads(s) else None  # offloaded: straight to the host
        ckpt.load_stage(
            first, s, mod, prepared.optimizers[s], settled.place.device, load, state_device
        )
    ckpt.load_rank(first)
    mixed.restore((manifest or {}).get("state", {}))
    executor.restore_versions(ckpt.load_versions(first))


def after_steps(*hooks):
    """One on_stepped hook calling those given (None: absent), in order."""
    hooks = [h for h in hooks if h is not None]
    if not hooks:
        return None

    def call(event, step):
        for hook in hooks:
            hook(event, step)

    return call
