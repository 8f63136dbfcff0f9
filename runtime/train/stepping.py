"""Optimizer steps of this rank's stages, at the points the dataflow chose.

    stepper = Stepper(topo, rank, modules, optimizers, comm, lr_of=lr_of, clip=clip)
    stepper.on_step(action, event)    # at every S action; the event (if any) is applied now

At a step: with replicas, wait for the stage's gradients summed with its replicas' (each
replica then holds the same mean gradient of the whole batch); clip by the norm over
everything stepped together (all of the pipeline's ranks when synchronous, the one stage
when not), set the learning rate, step, clear the gradients. Under mixed
precision (`precision.MixedPrecision`) the optimizer steps the fp32 masters and the stages'
16-bit weights are copied from them (with --offload-optimizer the masters are on the host:
their gradients' copies are waited for at the stage's S, the step runs on the CPU, on a
thread of the rank beside its next actions, and the weights are copied back where the
stage's weights are next read: `offload.HostOffload.launch`, not with replicas, whose
all-reduce sums into the masters' gradients as they arrive); under fp16 the same norm,
summed over every rank, is the overflow check: not finite anywhere, and every rank skips the
step. A weight read by several stages has one owner, whose gradient already sums every use
(the readers sent theirs back), so nothing is summed here. A stage puts its gradients aside at its own S, so
backwards of the next step cannot leak into them while the stages it steps with catch up.
With sharded optimizer state (`zero`) a replica steps its slices of its stages, and the
norm sums the slices' over the replicas too (`zero.replica_norms`).
"""

from __future__ import annotations

import contextlib
import math

import torch

from ..errors import PipelineConfigError
from .optim import clip_coef, squared_norm
from .zero import replica_norms


class Stepper:
    def __init__(
        self,
        topo,
        rank,
        modules,
        optimizers,
        comm,
        *,
        lr_of,
        clip: float = 0.0,
        on_stepped=None,
        precision=None,
    ):
        self.topo, self.rank, self.modules, self.optimizers = topo, rank, modules, optimizers
        self.comm, self.lr_of, self.clip = comm, lr_of, clip
        self.on_stepped = on_stepped
        self.precision = precision  # a MixedPrecision: masters, loss scale; None: fp32
        self.grad_sync = None  # with replicas: the stage's gradients summed before its step
        self.on_grads = None  # called with the event once its gradients are in, before clipping
        # called with (step, squared gradient norm) where that norm covers the whole pipeline
        # (a synchronous step that clips or checks fp16 overflow computes it anyway): the log's
        self.on_norm = None
        self._aside: dict[tuple[int, int], dict[str, torch.Tensor | None]] = {}

    def on_step(self, action, event=None) -> None:
        """A stage's S: put its gradients aside; apply `event` (a Dataflow StepEvent) if any."""
        if self.precision is not None:  # offloaded: the last step done, the gradients' copies
            self.precision.land(action.stage)  # to the host landed
            self.precision.settle(action.stage)
        if self.grad_sync is not None:  # the replicas' mean gradient, into the masters' .grad
            self.grad_sync.wait(action.stage, action.mb)
        self._aside[(action.stage, action.mb)] = {
            n: p.grad for n, p in self._trainable(action.stage)
        }
        for _, p in self._trainable(action.stage):
            p.grad = None
        if event is not None:
            self.apply(event)

    def apply(self, ev) -> None:
        for s in ev.stages:
            aside = self._aside.pop((s, ev.step), {})
            for n, p in self._trainable(s):
                p.grad = aside.get(n)
        if self.on_grads is not None:
            self.on_grads(ev)
        step = ev.step
        launched: set[int] = set()
        if self._checked_and_clipped(ev, step):
            lr = self.lr_of(step)
            for s in ev.stages:
                opt = self.optimizers.get(s)
                if opt is None:
                    continue
                for group in opt.param_groups:
                    group["lr"] = lr
                if self._overlapped(s):  # the gradients are spent on the host's thread
                    self.precision.launch(s, opt.step)
                    launched.add(s)
                    continue
                with self._stepping(s):
                    opt.step()
                if self.precision is not None:
                    self.precision.after_step(s)
        for s in set(ev.stages) - launched:  # stepped, or skipped: the gradients are spent
            for _, p in self._trainable(s):
                p.grad = None
        if self.on_stepped is not None:
            self.on_stepped(ev, ev.step)

    def _overlapped(self, stage: int) -> bool:
        """Does the stage's offloaded step run beside the rank's next actions? Not with
        replicas: their all-reduce sums into the masters' `.grad` as gradients arrive."""
        return (
            self.precision is not None and self.grad_sync is None and self.precision.overlaps(stage)
        )

    def _stepping(self, stage: int):
        """Around a stage's optimizer step (offloaded: the CPU step, timed)."""
        if self.precision is None:
            return contextlib.nullcontext()
        return self.precision.stepping(stage)

    def _trainable(self, stage: int):
        if self.precision is not None:
            return self.precision.stepped(stage)
        return [(n, p) for n, p in self.modules[stage].named_parameters() if p.requires_grad]

    def _checked_and_clipped(self, ev, step: int) -> bool:
        """Clip by the norm over every rank stepping here; under loss scaling first undo the
        scale and skip the step (False) when that norm is not finite anywhere."""
        scaled = self.precision is not None and self.precision.loss_scale is not None
        if not (self.clip or scaled):
            return True
        if scaled:
            for s in ev.stages:
                self.precision.poison(s, step)
        shards = self.precision.shards if self.precision is not None else {}
        whole, part = [], []  # the gradients the replicas share, and this replica's slices'
        for s in ev.stages:
            grads_of = part if s in shards else whole
            grads_of += [p.grad for _, p in self._trainable(s) if p.grad is not None]
        replicas = self.precision.sharded_over if self.precision is not None else 1
        device = self.comm.device
        total = replica_norms(
            self.comm, squared_norm(whole).to(device), squared_norm(part).to(device),
            ev.ranks, replicas, "the gradient norm",
        )  # fmt: skip
        grads = whole + part
        if self.on_norm is not None and len(set(ev.ranks)) == self.topo.world:
            self.on_norm(step, total)
        if scaled and not self.precision.checked(grads, total, step):
            return False
        if not scaled:
            _finite(total, step, ev.stages)
        if self.clip:
            coef = clip_coef(total, self.clip)
            for g in grads:
                g.mul_(coef.to(g.device, g.dtype))  # offloaded: the gradients are on the host
        return True


def _finite(total: torch.Tensor, step: int, stages) -> None:
    """Stop before a step whose gradient norm is not a number: the step would make every
    weight it touches nan, and each checkpoint after it would keep them (Megatron-LM checks
    the same by default). Under fp16 such a step is an overflow, skipped instead (`checked`).
    Reading the norm waits for the device once a step; the norm is computed anyway."""
    value = float(total)
    if not math.isfinite(value):
        which = ", ".join(map(str, sorted(stages)))
        raise PipelineConfigError(
            f"the gradient norm of step {step + 1} is {math.sqrt(value) if value >= 0 else value} "
            f"(stages {which}): a weight, an activation or the data is no longer a finite number; "
            "the run stops before the step changes the weights: lower --lr, check the weights "
            "it starts from, or resume from an earlier checkpoint"
        )
