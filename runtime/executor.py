"""Executes one rank's action list: forwards, backwards (with recompute) and steps.

    ex = Executor(topo, rank, modules, flow, comm, data, stepper, micro_batches, device)
    ex.run(actions, after=callback)       # callback(index, action) after each action

Stage inputs are detached leaves whatever their source (the same rank or a message), so
every stage backpropagates on its own and hands the input gradients upstream the same way:
summed over this rank's consumers, then sent once per producer rank. Integer tensors
(masks, ids) never carry gradients. A parameter read by several stages is an output of its
owner stage like any other: readers get a copy of its value at the owner's forward (the
version that micro-batch sees, however many steps the owner takes before the readers run),
and the gradient they send back reaches the parameter's `.grad` through the owner's backward.

Weight versions (`flow.weights`, from the schedule's policy): an action whose version of
its stage's weights is needed after the stage steps past it runs on a copy set aside at
its first use (`torch.func.functional_call`), so kept graphs never see the step's in-place
update; the copy's gradients are added to the parameters' `.grad`, and the copy is dropped
after its last use. Every other action runs on the parameters themselves.
"""

from __future__ import annotations

import contextlib
import time

import torch

from .errors import PipelineConfigError


class Executor:
    def __init__(
        self, topo, rank, modules, flow, comm, data, stepper, micro_batches, device, on_loss=None
    ):
        self.topo, self.rank, self.modules, self.flow = topo, rank, modules, flow
        self.comm, self.data, self.stepper = comm, data, stepper
        self.m, self.device, self.on_loss = micro_batches, torch.device(device), on_loss
        self.mb_offset = 0  # micro-batches done before this run (resume)
        self.loss_scale = lambda: 1.0  # fp16: the loss multiplier (precision.MixedPrecision)
        self.grad_sync = None  # with replicas: a GradSync summing each step's gradients
        self.start = time.perf_counter()
        self.recompute: dict[tuple[int, int], bool] = {}
        self.acts = Outputs(topo, rank, comm, "act")
        self.grads: dict[tuple[str, int], torch.Tensor] = {}  # (tensor, mb) -> summed gradient
        self.saved: dict[tuple[int, int], tuple] = {}  # (stage, mb) -> inputs, rng, outputs
        self.losses: dict[int, dict[int, torch.Tensor]] = {}  # step -> {mb: loss}
        self.weights = flow.weights.get(rank)
        self.stepped = dict.fromkeys(modules, 0)  # optimizer steps taken, per stage
        self.stash: dict[tuple[int, int], dict[str, torch.Tensor]] = {}  # (stage, version)
        self._drop: dict[int, list[tuple[int, int]]] = {}  # action index -> stashes to free
        if self.weights is not None:
            for key in self.weights.stashed:
                self._drop.setdefault(self.weights.last_use[key], []).append(key)
        # One handler per action kind; evaluation's ("E") is added by the run when it has one.
        self.handlers = {"F": self.forward, "B": self.backward, "S": self.step}

    def run(self, actions, after=None) -> None:
        self.start = time.perf_counter()
        self.recompute = {(a.stage, a.mb): a.recompute for a in actions if a.kind == "B"}
        for i, a in enumerate(actions):
            self.handlers[a.kind](i, a)
            for key in self._drop.get(i, ()):
                del self.stash[key]
            if after is not None:
                after(i, a)

    # --- forward ---
    def forward(self, i: int, a) -> None:
        s, m = a.stage, a.mb
        inputs = {
            n: self.data.get(n, m + self.mb_offset).to(self.device)
            for n in self.topo.model_inputs[s]
        }
        for t in self.topo.inputs[s]:
            leaf = self.acts.take(t, m).detach()
            inputs[t] = leaf.requires_grad_(True) if self.topo.transfers[t].grad else leaf
        keep_graph = not self.recompute.get((s, m), False)
        rng = None if keep_graph else _rng_state(self.device)
        params = self._version(s, m)
        with torch.set_grad_enabled(keep_graph):
            out = self._call(s, params, inputs)
        self.saved[(s, m)] = (inputs, rng, out if keep_graph else None, params)
        for t in self.topo.outputs[s]:
            self.acts.put(t, m, self._checked(t, out))
        if s == self.topo.loss_stage:
            self._record_loss(m, out["loss"].detach().float())

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
        # The losses and when this rank finished the step's forwards (ranks start together).
        values = torch.stack([step[j] for j in sorted(step)]).double().cpu()
        message = torch.cat([values, torch.tensor([time.perf_counter() - self.start])])
        del self.losses[k]
        if self.comm.global_rank != 0:
            self.comm.send_loss(k, message.to(self.device))
        elif self.on_loss is not None:
            self.on_loss(k, message)

    # --- backward ---
    def backward(self, i: int, a) -> None:
        s, m = a.stage, a.mb
        inputs, rng, out, params = self.saved.pop((s, m))
        if out is None:
            with _replay(rng, self.device), torch.enable_grad():
                out = self._call(s, params, inputs)
        roots, grads = [], []
        if s == self.topo.loss_stage:
            # Gradients accumulate over the step (and carry fp16's loss scale).
            roots.append(out["loss"] * (self.loss_scale() / self.m))
            grads.append(None)
        for t in self.topo.outputs[s]:
            if self.topo.transfers[t].grad:
                g = self._gather_grad(t, m)
                if out[t].requires_grad:
                    roots.append(out[t])
                    grads.append(g)
        sync = self.grad_sync
        if sync is not None:
            sync.before_backward(s, m)
        if roots:
            torch.autograd.backward(roots, grads)
        if params is not None:  # a set-aside version: its gradients are the stage's
            own = dict(self.modules[s].named_parameters())
            for n, t in params.items():
                if t.grad is not None:
                    p = own[n]
                    p.grad = t.grad if p.grad is None else p.grad + t.grad
                    t.grad = None
        if sync is not None:
            sync.after_backward(s, m)
        for t in self.topo.inputs[s]:
            info = self.topo.transfers[t]
            if not info.grad:
                continue
            x = inputs[t]
            g = x.grad if x.grad is not None else torch.zeros_like(x)
            have = self.grads.get((t, m))
            self.grads[(t, m)] = g if have is None else have + g
            if self.flow.grad_sender.get((self.rank, t, m)) == s:
                dst = self.topo.rank_of[info.producer]
                self.comm.send(dst, ("grad", t, m), self.grads.pop((t, m)))

    def _gather_grad(self, t: str, m: int) -> torch.Tensor:
        """This rank's consumers' gradients (already summed) plus one per consumer rank."""
        total = self.grads.pop((t, m), None)
        for src in self.topo.remote_ranks(t):
            g = self.comm.recv(src, ("grad", t, m))
            total = g if total is None else total + g
        if total is None:
            info = self.topo.transfers[t]
            total = torch.zeros(info.shape, dtype=info.dtype, device=self.device)
        return total

    # --- step ---
    def step(self, i: int, a) -> None:
        key = (a.stage, self.stepped[a.stage])
        if self.weights is not None and key in self.weights.stashed and key not in self.stash:
            self.stash[key] = self._copy(a.stage)
        self.stepper.on_step(i, a)
        self.stepped[a.stage] += 1

    # --- weight versions ---
    def _version(self, s: int, m: int) -> dict[str, torch.Tensor] | None:
        """The set-aside weights micro-batch m of stage s runs on, or None: the parameters."""
        if self.weights is None:
            return None
        key = (s, self.weights.version.get((s, m)))
        if key not in self.weights.stashed:
            return None
        if key not in self.stash:  # its first use: the version is the current one
            self.stash[key] = self._copy(s)
        return self.stash[key]

    def _copy(self, s: int) -> dict[str, torch.Tensor]:
        return {
            n: p.detach().clone().requires_grad_(True)
            for n, p in self.modules[s].named_parameters()
            if p.requires_grad
        }

    def _call(self, s: int, params, inputs: dict):
        if params is None:
            return self.modules[s](**inputs)
        return torch.func.functional_call(self.modules[s], params, args=(), kwargs=inputs)


class Outputs:
    """Stage outputs of one kind of forward ("act": training, "eval": evaluation), by (tensor,
    micro-batch): kept for this rank's consumers until their last use, and sent once to
    every other rank that consumes them."""

    def __init__(self, topo, rank: int, comm, kind: str):
        self.topo, self.rank, self.comm, self.kind = topo, rank, comm, kind
        self.held: dict[tuple[str, int], list] = {}  # (tensor, mb) -> [value, uses left]

    def put(self, t: str, m: int, value: torch.Tensor) -> None:
        value = value.detach()
        if self.topo.transfers[t].weight:  # the parameter itself: steps would change it
            value = value.clone()
        uses = len(self.topo.local_consumers(t, self.rank))
        if uses:
            self.held[(t, m)] = [value, uses]
        for dst in self.topo.remote_ranks(t):
            self.comm.send(dst, (self.kind, t, m), value)

    def take(self, t: str, m: int) -> torch.Tensor:
        entry = self.held.get((t, m))
        if entry is None:
            src = self.topo.rank_of[self.topo.transfers[t].producer]
            value = self.comm.recv(src, (self.kind, t, m))
            entry = self.held[(t, m)] = [value, len(self.topo.local_consumers(t, self.rank))]
        entry[1] -= 1
        if entry[1] == 0:
            del self.held[(t, m)]
        return entry[0]


def _rng_state(device: torch.device) -> tuple:
    cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    return torch.get_rng_state(), cuda


@contextlib.contextmanager
def _replay(state, device: torch.device):
    """Run with the RNG as it was at the forward (dropout masks repeat), then restore it."""
    cpu, cuda = state
    with torch.random.fork_rng(devices=[device] if cuda is not None else []):
        torch.set_rng_state(cpu)
        if cuda is not None:
            torch.cuda.set_rng_state(cuda, device)
        yield
