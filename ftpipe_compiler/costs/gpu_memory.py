"""What one GPU of a plan holds at its peak, by what holds it: its stages, and what the runtime
keeps around them.

    parts = gpu_memory(plan, gpu)                      # GpuMemory: .stages, .sends, ..., .total
    parts = gpu_memory(plan, gpu, in_flight={0: 4, 1: 1}, post_ahead_bytes=2**20)

The stages' own memory is `formulas.stage_memory` (weights, gradients, optimizer state,
in-flight inputs or activations, one backward's recompute), as the partitioners count it. Beside
it, each by the rule of the runtime code that holds it:

- received weights: a weight of another GPU's stage read here (a tied embedding), held from
  the first forward reading a version to the last backward of it (`outputs.Outputs`): the
  versions the readers' micro-batches in flight span; a stage that recomputes already counts
  it with its inputs;
- their gradient, summed over the step by the readers here before it goes to the owner's
  backward (`executor`);
- sends held until delivered: an asynchronous schedule sends each weight version as a copy;
  gloo (`MemoryReserve.sends_held`) reports a send delivered only when waited for, so the
  runtime holds the activations and gradients a step sends until its step (`comm.Comm.settle`;
  two steps' under an asynchronous schedule, with the previous step's weight gradient);
- receive buffers posted ahead of need, per source `formulas.posted_bytes` of one step's
  messages (`comm.Comm.post_ahead`, `--post-ahead`); on a CPU rank a synchronous schedule's
  next weights land where the version they replace goes (`MemoryView.lands_late`);
- with replicas, a flat copy of every trainable gradient for their all-reduce
  (`replicas.GradSync`); where a stage shards its optimizer state (`zero`), the flat copy
  its reduce-scatter reads and the 1/replicas chunk it lands in (the all-gather of the new
  weights after the step, at most two buckets at once, comes after those are let go);
- during a backward, autograd's gradient of the largest tensor before it is added into its sum
  (in the tensor's dtype; a stage on a set-aside version copies its first one into the sum,
  beside it, `precision.add_grad`; a stage reading it twice holds both, `Stage.reread`);
  under mixed precision the hook adds it into its fp32 sum with no fp32 copy of it
  (`precision.add_into`);
- the device's reserve (`formulas.MemoryReserve`): context, a communicator per process group
  (one per directed pair of GPUs that exchange messages, and the job's own), fragmentation;
- where the device is the host (a CPU rank: `Host.device_is_host`), what its stages offload
  (`host.stage_host_bytes`): the same memory. A stage that offloads its optimizer keeps no
  master or state here, no gradient sum unless it sums them on the device
  (`Offload.sums_on_device`).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields, replace

from ftpipe_runtime.engine.comm import POST_AHEAD_BYTES, POST_AHEAD_MESSAGES
from ftpipe_runtime.schedules import resolve_schedule

from .formulas import PRECISIONS, gpu_memory_bytes, posted_bytes
from .host import stage_host_bytes

__all__ = ["GpuMemory", "MemoryView", "gpu_memory", "grad_bytes"]


@dataclass(frozen=True)
class GpuMemory:
    """Peak bytes of one GPU by what holds them (all but `reserve` are tensors)."""

    stages: int  # weights, gradients, optimizer state, in-flight inputs or activations
    received_weights: int  # other GPUs' weights read here, the versions in use
    weight_grads: int  # their gradients summed over a step here
    sends: int  # messages sent, held until delivered
    posted: int  # receive buffers posted ahead of need
    replicas: int  # flat gradient copies for the replicas' all-reduce
    transient: int  # one backward's gradient of the largest tensor, before it is summed
    reserve: int  # context, communicators, fragmentation
    host: int = 0  # offloaded, where the device is the host (a CPU rank): the same memory

    @property
    def tensors(self) -> int:
        return self.total - self.reserve

    @property
    def total(self) -> int:
        return sum(getattr(self, f.name) for f in fields(self))

    def to_json(self) -> dict:
        return {**asdict(self), "total": self.total}


def gpu_memory(
    plan,
    gpu: int,
    in_flight: dict[int, int] | None = None,
    deferred: dict[int, int] | None = None,
    post_ahead_bytes: int = POST_AHEAD_BYTES,
    view: MemoryView | None = None,
    apart=None,
) -> GpuMemory:
    """GPU `gpu` of `plan` at its peak; micro-batches in flight (and, split, between B and W)
    per stage from the schedule unless given (the simulator's peaks), and so the offloaded
    stages holding a second gradient sum (`apart`: the simulator's, `host.stage_host_bytes`).
    `view`: the plan's `MemoryView`, made once where many GPUs or peaks of one plan are asked
    (`Plan`)."""
    view = view or MemoryView(plan)
    mine = plan.stages_on(gpu)
    policies = {}
    for s in mine:
        policy = plan.policies[s.id]
        if in_flight:
            policy = replace(policy, in_flight=in_flight[s.id])
        if deferred:
            policy = replace(policy, deferred=deferred[s.id])
        policies[s.id] = policy
    parts = [plan.stage_memory(s, in_flight, deferred) for s in mine]
    stages = gpu_memory_bytes(parts)
    read = [t for t in view.weights if view.read_on(t, gpu)]
    copies = sum(
        t.bytes * view.versions_read(t, gpu, policies) for t in read if view.copied(t, gpu)
    )
    wgrads = [t.bytes for t in read if t.requires_grad]
    # Autograd's gradient of one tensor, in its own dtype, before it is added into its sum;
    # a stage running on a set-aside version hands it to the weights' sum as autograd makes
    # it (`executor._aside`), the first one copied there (`precision.add_grad`), beside it.
    # A stage reading a weight twice holds both its gradients before adding one into the other.
    reread = {n for s in mine for n in s.reread}
    aside = any(policies[s.id].weight_delay for s in mine)
    own = [
        view.params[n].bytes * (2 if aside or n in reread else 1)
        for s in mine
        for n in s.params
        if view.params[n].trainable
    ]
    got = [t.bytes * (2 if t.tensor in reread else 1) for t in read if t.requires_grad]
    largest = max([*own, *got], default=0)
    tensors = GpuMemory(
        stages=int(stages),
        received_weights=copies,
        weight_grads=sum(wgrads),
        sends=view.sends(gpu, held=plan.reserve.sends_held),
        posted=view.posted(gpu, post_ahead_bytes),
        replicas=view.replica_buffers(mine),
        transient=largest,
        reserve=0,
        host=sum(
            stage_host_bytes(plan, s, in_flight[s.id] if in_flight else None, apart) for s in mine
        )
        if plan.host.device_is_host
        else 0,
    )
    reserve = plan.reserve.bytes(tensors.total, view.communicators(gpu))
    return replace(tensors, reserve=math.ceil(reserve))


def grad_bytes(p, precision) -> int:
    """A plan parameter's gradient as the runtime sums it (and the replicas sum it): its
    weight's bytes at the precision's gradient size for its compute dtype (fp32 under mixed
    precision; a tensor of another dtype keeps its own); 0 where it does not train."""
    if not p.trainable:
        return 0
    if p.dtype == precision.compute:
        return p.bytes * precision.grad // precision.weight
    return p.bytes


class MemoryView:
    """The plan as the runtime sees it: which transfers are weights, who sends what to whom.
    What depends on the plan alone (never on the micro-batches in flight) is kept: the
    simulator and the partitioners' memory checks ask for every GPU of one plan, often."""

    def __init__(self, plan):
        self.plan = plan
        self.params = {p.name: p for p in plan.params}
        self.gpu_of = {s.id: s.gpu for s in plan.stages}
        self.m = plan.micro_batches
        self.synchronous = resolve_schedule(plan.schedule).synchronous
        self.precision = PRECISIONS[plan.model.get("precision") or "fp32"]
        self.weights = [t for t in plan.transfers if t.tensor in self.params]
        self.activations = [t for t in plan.transfers if t.tensor not in self.params]
        self._dests = {id(t): self._reached(t) for t in plan.transfers}
        self._posted: dict[tuple[int, int], int] = {}
        self._pairs: set[tuple[int, int]] | None = None

    def _reached(self, t) -> set[int]:
        return {self.gpu_of[c] for c in t.consumers} - {self.gpu_of[t.producer]}

    def dests(self, t) -> set[int]:
        """GPUs other than its producer's that read transfer t."""
        got = self._dests.get(id(t))
        return self._reached(t) if got is None else got

    def remote(self, t, gpu: int) -> bool:
        return self.gpu_of[t.producer] != gpu

    def read_on(self, t, gpu: int) -> bool:
        return any(self.gpu_of[c] == gpu for c in t.consumers)

    def copied(self, t, gpu: int) -> bool:
        """Do the readers of weight t on `gpu` hold a copy of it? Received from another GPU,
        or made on its owner's (an asynchronous schedule passes each version as a copy)."""
        return self.remote(t, gpu) or not self.synchronous

    def versions_read(self, t, gpu: int, policies: dict) -> int:
        """Copies of weight t the readers on `gpu` hold that their stage memory does not count
        (a recomputing reader keeps it with each in-flight micro-batch's inputs): the versions
        their micro-batches in flight span (the owner steps once every m of them), at most
        the pinned delay's (a newer version waits in a receive buffer, counted there)."""
        readers = [c for c in t.consumers if self.gpu_of[c] == gpu]
        if all(policies[c].recompute for c in readers):
            return 0
        most = max(policies[c].in_flight for c in readers)
        spanned = 1 + math.ceil((most - 1) / self.m)
        delay = self.plan.policies[t.producer].weight_delay
        return spanned if delay is None else min(spanned, delay + 1)

    def grad_bytes(self, p) -> int:
        return grad_bytes(p, self.precision)

    def sends(self, gpu: int, held: bool) -> int:
        """Messages sent and not yet let go (`comm.Comm`): the copies of each weight version
        an asynchronous schedule sends, and where sends are `held` till a step waits for them
        everything a step sent (the activations and input gradients; a synchronous step's
        weights are the parameters and its weight gradient the sum counted already)."""
        mine = [t for t in self.weights if not self.remote(t, gpu) and self.dests(t)]
        clones = 0 if self.synchronous else sum(t.bytes for t in mine)
        if not held:
            return clones
        per_step = sum(
            self.m * t.bytes for t in self.activations if not self.remote(t, gpu) and self.dests(t)
        ) + sum(
            self.m * t.bytes
            for t in self.activations
            if t.requires_grad and self.remote(t, gpu) and gpu in self.dests(t)
        )
        if self.synchronous:
            return per_step
        wgrads = sum(
            t.bytes
            for t in self.weights
            if t.requires_grad and self.remote(t, gpu) and gpu in self.dests(t)
        )
        return 2 * (per_step + clones) + wgrads

    def posted(self, gpu: int, ahead_bytes: int) -> int:
        """Receive buffers posted ahead on `gpu`, all its sources together (`posted_bytes`)."""
        key = (gpu, ahead_bytes)
        if key not in self._posted:
            self._posted[key] = sum(
                posted_bytes(
                    [size for size, _ in sizes],
                    ahead_bytes,
                    POST_AHEAD_MESSAGES,
                    held=[0 if late else size for size, late in sizes],
                )
                for sizes in self.messages_to(gpu).values()
            )
        return self._posted[key]

    def messages_to(self, gpu: int) -> dict[int, list[tuple[int, bool]]]:
        """Per source GPU: one step's messages to `gpu` in sending order, (bytes, does its
        posted buffer stay empty through the peak: `lands_late`)."""
        one: dict[int, list[tuple[int, bool]]] = {}  # each micro-batch sends the same
        for t in self.activations:  # activations down
            if gpu in self.dests(t):
                one.setdefault(self.gpu_of[t.producer], []).append((t.bytes, False))
        for t in self.activations:  # their gradients back
            if t.requires_grad and not self.remote(t, gpu):
                for src in self.dests(t):
                    one.setdefault(src, []).append((t.bytes, False))
        out = {src: sizes * self.m for src, sizes in one.items()}
        for t in self.weights:  # a weight once per version, its gradient once per step
            if gpu in self.dests(t):
                out.setdefault(self.gpu_of[t.producer], []).append((t.bytes, self.lands_late(t)))
            if t.requires_grad and not self.remote(t, gpu):
                for src in self.dests(t):
                    out.setdefault(src, []).append((t.bytes, False))
        return out

    def lands_late(self, t) -> bool:
        """Does weight t's next version, posted for on its readers' GPUs, hold no memory
        there through their peak? Where the device is the host a buffer's pages are mapped
        as its message lands, and under a synchronous schedule the owner sends it after its
        step, which waits for the readers' gradient of the step's last micro-batch: after
        their last backward, where the version it replaces is let go (not where they split
        it: zb1p's rank 1 measured 1.15 x a plan leaving it out, under load). Under an
        asynchronous one it may land before the readers' peak, or after: timing (FTPipe's
        rank 1 of tests/runtime/job/test_memory_plan.py measured 0.89 and 1.02 x a plan
        counting it, 1.07 and 1.22 x one that did not); counted. A GPU's caching allocator
        holds the buffer from the post."""
        if not (self.plan.host.device_is_host and self.synchronous):
            return False
        # A split backward sends the readers' gradient at their last B, and their W work
        # (their own weights' gradients) runs after it: the next version may land by then.
        return not any(self.plan.policies[c].split for c in t.consumers)

    def communicators(self, gpu: int) -> int:
        """Process groups this GPU is in: one per directed pair it exchanges messages in
        (`comm.Comm.make_groups`), the job's own, and with replicas theirs."""
        if self._pairs is None:
            self._pairs = set()
            for t in self.plan.transfers:
                src = self.gpu_of[t.producer]
                for dst in self.dests(t):
                    self._pairs.add((src, dst))
                    if t.requires_grad:
                        self._pairs.add((dst, src))
        return sum(1 for p in self._pairs if gpu in p) + 1 + (self.plan.replicas > 1)

    def replica_buffers(self, stages) -> int:
        d = self.plan.replicas
        if d <= 1:
            return 0
        total = 0
        for s in stages:
            grads = sum(self.grad_bytes(self.params[n]) for n in s.params)
            total += grads + (-(-grads // d) if s.sharded_over(d) > 1 else 0)
        return total
