"""Executes one rank's actions: forwards, backwards (with recompute) and steps.

    ex = Executor(topo, rank, modules, flow, comm, data=data, stepper=stepper,
                  micro_batches=m, device=device, seed=0, precision=mixed)
    ex.run(flow.actions(rank), after=callback)   # callback(index, planned) after each action

Stage inputs are detached leaves whatever their source (the same rank or a message), so
every stage backpropagates on its own and hands the input gradients upstream the same way:
summed over this rank's consumers, then sent once per producer rank. Integer tensors
(masks, ids) never carry gradients. A parameter read by several stages is an output of its
owner stage like any other: readers get its value at the owner's forward, once per version
(the version that micro-batch sees, however many steps the owner takes before the readers
run: a copy, unless the schedule is synchronous and every reader is done with it before the
owner steps again), and the gradient they send back, summed over the step, reaches the
parameter's `.grad` through the owner's last backward of the step.

Split backwards (zero-bubble schedules: the stage's policy says `split`, and a W follows each
B): B computes the input gradients and
sends them upstream as a full backward would, keeping the graph; W computes the weight
gradients later (`split_backward`), and the micro-batch's graph is released then. W's
gradients go where autograd's would (`MixedPrecision.add_grad`: under bf16 and fp16 into the
fp32 masters at once, and the replicas' all-reduce told), not into the 16-bit weights.

Weight versions (`schedules.Versions`, from the schedule's policy): an action whose version
of its stage's weights is needed after the stage steps past it runs on a copy set aside
(`torch.func.functional_call`), so kept graphs never see the step's in-place update; the
copy's gradients are the parameters': added by the same path (`MixedPrecision.add_grad`),
each as autograd makes it (a hook on the copy), so a backward on a copy holds one of them
at a time beside the sum, not a whole set of the stage's gradients until its end.
A resumed run gets the copies its first steps need from the checkpoint (`restore_versions`).
An offloaded stage's CPU step may run beside the actions after its S (`offload.HostOffload`):
it lands wherever the stage's weights themselves are next read (a call on them, a copy set
aside, the stage's next S, an evaluation, a weight sent at a step, the run's end), so under
PipeDream-2BW or WPipe the stage's own actions on the older version overlap it; a lagged
stage's (`--offload-step lagged`) at its next S only, its actions meanwhile on the older
weights, which its checkpoint keeps (`kept_versions`, `restore_versions`).

Frozen weights (`frozen`): a stage with nothing trainable and no gradient crossing its
borders is forward-only: its forwards run without autograd and keep nothing, its B and W
are no-ops (`forward_only`).

Activation offload (`offload`, `act_offload.ActivationOffload`): what a forward keeps for its
backward (autograd's saved tensors, or a recomputing stage's inputs) waits on the host, and
comes back one backward ahead; it watches the rank's actions to see which backward is next.

Random numbers (dropout): a forward of micro-batch mb on stage s draws from a generator
seeded by (seed, s, mb), and its recompute from the same seed, so the masks do not depend on
what ran before: a resumed run that fills its pipeline again draws the very same ones.
"""

from __future__ import annotations

import contextlib
import time
import weakref
from functools import partial

import torch

from ..errors import PipelineConfigError
from ..schedules import Versions
from ..stage.frozen import forward_only_stages
from ..stage.fused_loss import pooled_weight_gradients, release_idle_gradients
from ..train.loss_weights import LossWeights
from ..train.precision import MixedPrecision, get_precision
from .act_offload import ActivationOffload
from .outputs import Outputs
from .split_backward import backward_input, backward_weight
from .trace import Tracer


class Executor:
    def __init__(
        self,
        topo,
        rank,
        modules,
        flow,
        comm,
        *,
        data,
        stepper,
        micro_batches: int,
        device,
        on_loss=None,
        seed: int = 0,
        precision: MixedPrecision | None = None,
    ):
        self.topo, self.rank, self.modules, self.flow = topo, rank, modules, flow
        self.comm, self.data, self.stepper = comm, data, stepper
        self.m, self.device, self.on_loss = micro_batches, torch.device(device), on_loss
        self.seed = seed
        # Each micro-batch's share of its step's label tokens: the loss is their sum over
        # their number, across micro-batches and replicas (as the HuggingFace Trainer's).
        self.loss_weights = LossWeights(data, micro_batches)
        # Where the weights' gradients go (fp32 masters under bf16/fp16), fp16's loss scale.
        if precision is None:
            precision = MixedPrecision(get_precision("fp32"), modules)
        self.precision = precision
        self.grad_sync = None  # with replicas: a GradSync summing each step's gradients
        self.tracer = Tracer()  # the hook around every action (a profiler range; --trace rows)
        self.start = time.perf_counter()
        self.acts = Outputs(topo, rank, comm, "act", flow)
        self.grads: dict[tuple[str, int], torch.Tensor] = {}  # flow.slot -> summed gradient
        self.backwards: dict[int, int] = {}  # stage -> its backwards of the step so far
        self.saved: dict[tuple[int, int], tuple] = {}  # (stage, mb) -> inputs, outputs, weights
        self.losses: dict[int, dict[int, torch.Tensor]] = {}  # step -> {mb: loss}
        self.policies = {s: flow.policies[s] for s in modules}
        self.forward_only = forward_only_stages(topo, modules)
        timeline = flow.timeline
        # Open-ended: the final checkpoint holds the versions a resumed run's first steps use.
        self.versions = Versions(self.policies, micro_batches, None, timeline.first)
        self.stash: dict[tuple[int, int], dict[str, torch.Tensor]] = {}  # (stage, version)
        self.now = None  # the Planned being run
        self.deferred: dict[tuple[int, int], tuple] = {}  # (stage, mb) -> what its W needs
        self.made: dict[str, torch.Tensor] = {}  # weight read by other ranks -> the parameter
        # One handler per action kind; evaluation's ("E") is added by the run when it has one.
        self.handlers = {"F": self.forward, "B": self.backward, "W": self.weight, "S": self.step}
        # Saved activations parked on the host between a forward and its backward (the run
        # sets one offloading its stages: `act_offload.of_run`); by default none.
        self.offload = ActivationOffload(self.device)

    def run(self, items, after=None) -> None:
        """Run `items` (Dataflow.actions(rank)) in order."""
        self.start = time.perf_counter()
        missing = sorted(self.versions.aside - set(self.stash))
        if missing:
            s, v = missing[0]
            raise PipelineConfigError(
                f"stage {s} needs its weights after {v} steps, which the checkpoint does not "
                "hold; it was saved by an older ftpipe: start afresh without --resume"
            )
        for i, item in enumerate(self.offload.watch(items)):
            self.now = item
            if item.action.kind == "E":  # evaluation reads the weights themselves
                self.precision.land(item.action.stage, reading=True)
                release_idle_gradients()  # idle beside the round's copy of the weights
            with self.tracer.action(item.action):
                self.handlers[item.action.kind](i, item.action)
            if after is not None:
                after(i, item)
        self.precision.land_all()  # what follows (a checkpoint, an export, a switch) reads them

    # --- forward ---
    def forward(self, i: int, a) -> None:
        s, m = a.stage, a.mb
        inputs = {n: self.data.get(n, m).to(self.device) for n in self.topo.model_inputs[s]}
        for t in self.topo.inputs[s]:
            leaf = self.acts.take(t, m).detach()
            inputs[t] = leaf.requires_grad_(True) if self.topo.transfers[t].grad else leaf
        keep_graph = not self.policies[s].recompute and s not in self.forward_only
        params = self._version(a)
        order = self.flow.sending_order(s)
        parking = self.offload.saving(s, m, keep_graph)
        with self._seeded(s, m), torch.set_grad_enabled(keep_graph), parking:
            out = self._call(s, params, inputs)
        if s not in self.forward_only:
            kept = self.offload.park(s, m, inputs, out, params, self.modules[s])
            self.saved[(s, m)] = (kept, out if keep_graph else None, params)
        for t in order:
            self.acts.put(t, m, self._checked(t, out))
            if self.flow.shared(t):
                self.made[t] = out[t]  # the parameter: the step below sends its next version
        if s == self.topo.loss_stage:
            _, share = self.loss_weights.of(m)
            # its share of the step's loss (0 for one with nothing to predict: a NaN mean)
            loss = out["loss"].detach().double()
            self._record_loss(m, loss * share if share else torch.zeros_like(loss))

    def _checked(self, t: str, out: dict) -> torch.Tensor:
        info = self.topo.transfers[t]
        value = out[t]
        if tuple(value.shape) != info.shape or value.dtype != info.dtype:
            raise PipelineConfigError(
                f"stage {info.producer} made {t} as {tuple(value.shape)} {value.dtype}, the plan "
                f"says {info.shape} {info.dtype}; the package and the plan disagree"
            )
        return value

    def _record_loss(self, m: int, loss: torch.Tensor) -> None:
        k = m // self.m
        step = self.losses.setdefault(k, {})
        step[m] = loss.reshape(())
        if len(step) < self.m:
            return
        # The micro-batches' shares of the step's loss and when this rank finished the
        # step's forwards (ranks start together), left on the device: reading them here
        # would wait for the GPU every step (`report.Progress` reads them when they are there).
        values = torch.stack([step[j] for j in sorted(step)]).double()
        when = torch.full((1,), time.perf_counter() - self.start, dtype=values.dtype,
                          device=values.device)  # fmt: skip
        message = torch.cat([values, when])
        del self.losses[k]
        if self.comm.global_rank != 0:
            self.comm.send_loss(k, message.to(self.device))
        elif self.on_loss is not None:
            self.on_loss(k, message)

    # --- backward ---
    def backward(self, i: int, a) -> None:
        s, m = a.stage, a.mb
        if s in self.forward_only:
            return
        inputs, out, params = self.saved.pop((s, m))
        inputs = self.offload.fetch(s, m, inputs)
        if out is None:
            # The version its forward read: the weights themselves then, set aside since
            # if the stage stepped in between (`Versions.use`).
            params = self._version(a)
            with self._seeded(s, m), torch.enable_grad():
                out = self._call(s, params, inputs)
        roots, grads = [], []
        if s == self.topo.loss_stage:
            # Gradients accumulate over the step (and carry fp16's loss scale); a micro-batch
            # with nothing to predict adds nothing (its loss is 0/0).
            weight, _ = self.loss_weights.of(m)
            if weight:
                roots.append(out["loss"] * (self.precision.multiplier() * weight))
                grads.append(None)
        last = self._counted_backward(s)
        split = self.policies[s].split
        # Weights whose gradient, summed over the step, is taken after the rest of the
        # backward ran (split: after the rest of W), not beside it: it is weight-sized (a tied
        # embedding's), and so is its own gradient from this stage. Not with replicas
        # (GradSync sends a parameter's gradient once it is in, so it must all be in at once).
        late, alone = [], self.grad_sync is None
        for t in self.topo.outputs[s]:
            if self.topo.transfers[t].grad:
                if self.flow.shared(t):
                    if not last:
                        continue  # its gradient, summed over the step, comes at the last one
                    if alone and out[t].requires_grad and out[t].grad_fn is None:
                        late.append(t)  # the parameter itself: it waits while the rest runs
                        continue
                g = self._gather_grad(t, m)
                if out[t].requires_grad:
                    roots.append(out[t])
                    grads.append(g)
        sync = self.grad_sync
        if split:  # the weights' gradients (and their all-reduce) come at W
            weights = params.values() if params is not None else self.modules[s].parameters()
            grad_inputs = [inputs[t] for t in self.topo.inputs[s] if self.topo.transfers[t].grad]
            later = backward_input(roots, grads, grad_inputs, list(weights))
            self.deferred[(s, m)] = (later, params, [(out[t], t) for t in late])
        else:
            if sync is not None:
                sync.before_backward(s, m)
            if roots:
                torch.autograd.backward(roots, grads)
            for t in late:  # a leaf: its gradient adds into .grad (and GradSync sees it)
                torch.autograd.backward(out[t], self._gather_grad(t, m))
            if sync is not None:
                sync.after_backward(s, m)
        for t in self.flow.grad_order(s):
            info = self.topo.transfers[t]
            if not info.grad:
                continue
            x = inputs[t]
            g = x.grad if x.grad is not None else torch.zeros_like(x)
            x.grad = None  # in the sum now; a split backward's graph keeps x alive till its W
            slot = self.flow.grad_slot(t, m)
            have = self.grads.get(slot)  # ours alone (an earlier x.grad): added to in place
            self.grads[slot] = g if have is None else have.add_(g)
            if self.now.sends_grad(t):
                dst = self.topo.rank_of[info.producer]
                self.comm.send(dst, self._grad_key(t, m), self.grads.pop(slot))

    def weight(self, i: int, a) -> None:
        if a.stage in self.forward_only:
            return
        later, params, late = self.deferred.pop((a.stage, a.mb))
        sync = self.grad_sync
        if sync is not None:
            sync.before_backward(a.stage, a.mb)
        own = self._owners(a.stage, params)
        backward_weight(later, lambda t, g: self.precision.add_grad(own(t), g))
        for leaf, t in late:  # a weight read by other stages: theirs, summed over the step
            self.precision.add_grad(own(leaf), self._gather_grad(t, a.mb))
        if sync is not None:
            sync.after_backward(a.stage, a.mb)

    def _owners(self, s: int, params):
        """tensor -> the stage's parameter it is (itself) or a set-aside copy of (`params`)."""
        if params is None:
            return lambda t: t
        own = dict(self.modules[s].named_parameters())
        by_copy = {id(t): own[n] for n, t in params.items()}
        return lambda t: by_copy[id(t)]

    def _counted_backward(self, s: int) -> bool:
        """Counts stage s's backwards: is this one the last of its step (the m-th)?"""
        n = self.backwards.get(s, 0) + 1
        self.backwards[s] = n % self.m
        return n == self.m

    def _grad_key(self, t: str, m: int) -> tuple:
        if self.flow.shared(t):
            return ("wgrad", t, m // self.m)
        return ("grad", t, m)

    def _gather_grad(self, t: str, m: int) -> torch.Tensor:
        """This rank's consumers' gradients (already summed) plus one per consumer rank."""
        total = self.grads.pop(self.flow.grad_slot(t, m), None)
        for src in self.topo.remote_ranks(t):
            g = self.comm.recv(src, self._grad_key(t, m))
            total = g if total is None else total + g
        if total is None:
            info = self.topo.transfers[t]
            total = torch.zeros(info.shape, dtype=info.dtype, device=self.device)
        return total

    # --- step ---
    def step(self, i: int, a) -> None:
        self.comm.settle(a.mb)  # S's mb is the step; once per step on this rank
        keep, drop = self.versions.step(a)
        for key in drop:  # before the new copy: no action after this step reads them
            self.stash.pop(key, None)
        if keep is not None and keep not in self.stash:
            self.stash[keep] = self._copy(a.stage)
        self.stepper.on_step(a, self.now.event)
        next_mb = (a.mb + 1) * self.m
        sends = dict.fromkeys(key[1] for _, key in self.now.sends)  # weights, new version
        if sends:
            self.precision.land_all()
        for t in sends:
            self.acts.put(t, next_mb, self.made[t])

    # --- weight versions ---
    def _version(self, a) -> dict[str, torch.Tensor] | None:
        """The set-aside weights action `a` runs on, or None: the parameters."""
        key = self.versions.use(a)
        if key is not None and key not in self.stash:  # its first use: the current version
            self.stash[key] = self._copy(a.stage)
        return None if key is None else self.stash[key]

    def kept_versions(self, stage: int, step: int) -> dict[int, dict[str, torch.Tensor]]:
        """The set-aside versions a run resumed at `step` needs (a checkpoint saves them); a
        lagged stage whose step has not landed: its weights, one version older than its
        masters (`offload.HostOffload`)."""
        if self.precision.lags(stage) and self.precision.offload.pending(stage):
            return {step - 1: dict(self.precision.weights(stage))}
        return {v: self.stash[(stage, v)] for v in self.versions.needed_at(stage, step)}

    @torch.no_grad()
    def restore_versions(self, kept: dict[tuple[int, int], dict[str, torch.Tensor]]) -> None:
        """Set-aside versions from a checkpoint, before `run` (a lagged stage's: its weights,
        its masters' values landing at its first step). One this run does not use (a lagged
        run's, resumed with exact steps) is left out: its weights are then its masters'."""
        for key, params in kept.items():
            s = key[0]
            if self.precision.lags(s):
                for name, weight in self.precision.weights(s):
                    weight.copy_(params[name])
                self.precision.defer(s)
                continue
            if key not in self.versions.aside:
                continue
            self.stash[key] = self._aside(
                s, {n: t.detach().to(self.device) for n, t in params.items()}
            )

    def _copy(self, s: int) -> dict[str, torch.Tensor]:
        self.precision.land(s, reading=True)
        params = self.modules[s].named_parameters()
        return self._aside(s, {n: p.detach().clone() for n, p in params if p.requires_grad})

    def _aside(self, s: int, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """`tensors` (a version of stage s's trainable weights, by name) as leaves whose
        gradient goes into its parameter's sum as soon as autograd has made it."""
        own = dict(self.modules[s].named_parameters())
        add = _adder(self.precision)
        for n, t in tensors.items():
            t.requires_grad_(True).register_post_accumulate_grad_hook(partial(add, own[n]))
        return tensors

    def _call(self, s: int, params, inputs: dict):
        with pooled_weight_gradients(s not in self.topo.reread):
            if params is None:  # the weights themselves: an overlapped step of the stage lands
                self.precision.land(s, reading=True)
                return self.modules[s](**inputs)
            return torch.func.functional_call(self.modules[s], params, args=(), kwargs=inputs)

    @contextlib.contextmanager
    def _seeded(self, stage: int, mb: int):
        """Random numbers of this stage's micro-batch mb, the same at the forward and the
        recompute and whatever ran before; the rank's own generator is left as it was."""
        cuda = [self.device] if self.device.type == "cuda" else []
        with torch.random.fork_rng(devices=cuda):
            torch.manual_seed(((self.seed * 1_000_003 + stage) * 1_000_033 + mb) % 2**63)
            yield


def _adder(precision):
    """A copy's hook: its gradient, taken from it, into `owner`'s sum (`add_grad`). Through a
    weak reference: the hook lives on the tensor's C++ side, out of the collector's sight."""
    ref = weakref.ref(precision)

    def add(owner: torch.Tensor, copy: torch.Tensor) -> None:
        g, copy.grad = copy.grad, None
        alive = ref()
        if alive is not None:
            alive.add_grad(owner, g)

    return add
