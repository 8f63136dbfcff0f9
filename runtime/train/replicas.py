"""Data parallelism: several replicas of the pipeline, each stage summing its gradients with its
replicas' before it steps.

    reps = Replicas.of(plan)            # plan["replicas"], plan["placement"]
    replica, gpu = reps.where(rank)     # this process: GPU `gpu` of the pipeline, replica `replica`
    reps.pipeline(replica)              # the ranks of one replica, by pipeline GPU
    reps.stage_group(gpu)               # the ranks holding GPU `gpu`'s stages, one per replica
    data = Shard(data, replica, reps.count, micro_batches)   # this replica's part of each batch
    sync = GradSync(mixed, comm, reps.stage_group(gpu), micro_batches)   # mixed: MixedPrecision

A step's batch is `replicas x micro_batches` micro-batches; replica r reads micro-batches
r*m .. r*m+m-1 of it, so d replicas together see what one pipeline would over d*m
micro-batches, and the averaged gradient is that of the whole batch.

What is summed is what the optimizer steps (`precision.MixedPrecision.trainable`): under bf16
and fp16 the fp32 masters' gradients, which hold the micro-batches' sum in fp32, so the
replicas' sum is taken in fp32 too (as DeepSpeed's bf16 optimizer reduces; 16-bit messages
would halve the bytes and round the sum of d replicas' gradients once more).
Gradients are reduced in buckets of at most `BUCKET_BYTES`, last parameters first (the order
a backward produces them): during the stage's last backward of a step each gradient's
arrival (`MixedPrecision.on_grad`: autograd's, or a split backward's weight pass) marks its
parameter done, and a bucket whose parameters are all done is handed to an asynchronous
all-reduce at once (after the buckets before it: every replica issues them in one order).
What the backward never reaches goes when it ends. At the stage's optimizer step
(`wait`) the sums arrive and are divided by the number of replicas. A weight read by several
stages lives in its owner, whose gradient already holds every reader's, so it is reduced
once like any other; the gradient norm for clipping is then the same on every replica and
equal to one process's over the whole batch.

A stage whose optimizer state is sharded (`zero.ShardedOptimizer`, `MixedPrecision.shards`)
is summed in its layout's buckets (the same rule, laid out in d equal chunks) by a
reduce-scatter instead: at the step each replica gets the mean of its own chunk of every
bucket (`ShardedOptimizer.take`), and the full gradients are freed.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch

from ..errors import PipelineConfigError

__all__ = [
    "BUCKET_BYTES",
    "GradSync",
    "LossGather",
    "Replicas",
    "Shard",
    "StepBackwards",
    "bucket_indices",
    "launch_hint",
]

BUCKET_BYTES = 25 * 2**20  # as torch's DistributedDataParallel


def bucket_indices(sizes: list[int], limit: int = BUCKET_BYTES) -> list[list[int]]:
    """Parameters (by index, in registration order, with their byte sizes) grouped into
    buckets in the order they are reduced: the last parameters first, each bucket at most
    `limit` bytes unless one parameter alone is bigger."""
    out: list[list[int]] = []
    size = limit
    for i in reversed(range(len(sizes))):
        if size + sizes[i] > limit and (not out or out[-1]):
            out.append([])
            size = 0
        out[-1].append(i)
        size += sizes[i]
    return [b for b in out if b]


@dataclass(frozen=True)
class Replicas:
    count: int  # replicas of the pipeline
    gpus: int  # GPUs of one pipeline
    placement: tuple[tuple[int, int], ...]  # per rank: (replica, GPU of the pipeline)

    @classmethod
    def of(cls, plan: dict) -> Replicas:
        try:
            count, gpus = int(plan.get("replicas", 1)), int(plan["gpus"])
            placement = tuple((int(r), int(g)) for r, g in plan.get("placement") or ())
        except (KeyError, TypeError, ValueError) as e:
            raise PipelineConfigError(f"the plan's replicas are unreadable ({e})") from None
        placement = placement or tuple((0, g) for g in range(gpus))
        want = sorted((r, g) for r in range(count) for g in range(gpus))
        if count < 1 or sorted(placement) != want:
            raise PipelineConfigError(
                f"the plan's placement does not give each of its {count} replicas' {gpus} "
                "GPUs exactly one rank; compile it again"
            )
        return cls(count, gpus, placement)

    @property
    def world(self) -> int:
        return len(self.placement)

    def where(self, rank: int) -> tuple[int, int]:
        return self.placement[rank]

    def rank(self, replica: int, gpu: int) -> int:
        return self._ranks[(replica, gpu)]

    @property
    def _ranks(self) -> dict[tuple[int, int], int]:
        return {rg: rank for rank, rg in enumerate(self.placement)}

    def pipeline(self, replica: int) -> tuple[int, ...]:
        ranks = self._ranks
        return tuple(ranks[(replica, g)] for g in range(self.gpus))

    def stage_group(self, gpu: int) -> tuple[int, ...]:
        ranks = self._ranks
        return tuple(ranks[(r, gpu)] for r in range(self.count))


class Shard:
    """The micro-batches of one replica: its m of every step's replicas x m."""

    def __init__(self, data, replica: int, replicas: int, micro_batches: int):
        self.data, self.replica, self.replicas, self.m = data, replica, replicas, micro_batches

    def global_mb(self, mb: int) -> int:
        step, j = divmod(mb, self.m)
        return (step * self.replicas + self.replica) * self.m + j

    def get(self, name: str, mb: int) -> torch.Tensor:
        return self.data.get(name, self.global_mb(mb))

    def __getattr__(self, name):  # everything else is the data source's own
        return getattr(self.data, name)


class GradSync:
    """Sums each stage's gradients with its replicas', bucket by bucket (see the module doc).
    `precision`: the rank's `MixedPrecision`, which says what is stepped and when a gradient
    arrived."""

    def __init__(self, precision, comm, group: tuple[int, ...], micro_batches: int):
        self.precision = precision
        self.comm, self.group, self.replicas = comm, tuple(sorted(group)), len(group)
        self.shards = precision.shards  # stage -> ShardedOptimizer: reduce-scattered
        for shard in self.shards.values():
            shard.bind(comm, self.group)
        self.last = StepBackwards(micro_batches)  # which backward is its step's last
        self.params: dict[int, list[torch.Tensor]] = {}  # stage -> tensors whose .grad is summed
        self.index: dict[int, dict[str, int]] = {}  # stage -> name -> position in params
        self.order: dict[int, list[list[int]]] = {}  # stage -> its buckets
        self.refresh()
        precision.on_grad = self._ready
        precision.stream_gradients()  # the sums must be in the masters' .grad as they arrive
        self._armed: dict[int, dict] = {}  # stage -> the backward in progress
        self._works: dict[int, list] = {}  # stage -> [(work, flat, bucket)] of its next step

    def refresh(self) -> None:
        """Sum only the parameters that still train (after freeze training froze some)."""
        for s in self.precision.stages:
            named = self.precision.trainable(s)
            self.params[s] = [t for _, t in named]
            self.index[s] = {n: i for i, (n, _) in enumerate(named)}
            shard = self.shards.get(s)
            self.order[s] = (
                [list(b.members) for b in shard.buckets]
                if shard is not None
                else bucket_indices([t.numel() * t.element_size() for _, t in named])
            )

    # --- the last backward of a step ---
    def before_backward(self, stage: int, mb: int) -> None:
        if not self.last.ends_step(stage) or not self.params[stage]:
            return
        self._armed[stage] = {"mb": mb, "done": set(), "next": 0}
        self._works[stage] = []

    def _ready(self, stage: int, name: str) -> None:
        """A gradient of `stage`'s weight `name` is in (`MixedPrecision.on_grad`)."""
        state = self._armed.get(stage)
        if state is None:  # not the step's last backward: nothing to start
            return
        state["done"].add(self.index[stage][name])
        self._launch(stage, state, flush=False)

    def after_backward(self, stage: int, mb: int) -> None:
        state = self._armed.pop(stage, None)
        if state is not None:
            self._launch(stage, state, flush=True)

    def _launch(self, stage: int, state: dict, flush: bool) -> None:
        """Start every bucket whose parameters are done (all of them with `flush`), in order."""
        buckets = self.order[stage]
        params = self.params[stage]
        while state["next"] < len(buckets):
            bucket = buckets[state["next"]]
            if not flush and not state["done"].issuperset(bucket):
                return
            parts = [
                (params[i].grad if params[i].grad is not None else torch.zeros_like(params[i]))
                .detach()
                .reshape(-1)
                for i in bucket
            ]
            shard = self.shards.get(stage)
            if shard is None:
                flat = torch.cat(parts)
                work = self.comm.all_reduce_async(flat, self.group)
                self._works[stage].append((work, flat, bucket))
            else:
                k = state["next"]
                flat = shard.flat(k, parts)
                out = flat.new_empty(shard.buckets[k].chunk)
                work = self.comm.reduce_scatter_async(out, flat, self.group)
                present = {i for i in bucket if params[i].grad is not None}
                self._works[stage].append((work, out, (k, present)))
            state["next"] += 1

    # --- the optimizer step ---
    def wait(self, stage: int, step: int) -> None:
        """Put the replicas' mean gradient of `stage`'s step into its parameters' `.grad`
        (sharded: of this replica's chunks into its slices', the full ones let go)."""
        params, shard = self.params[stage], self.shards.get(stage)
        for work, flat, bucket in self._works.pop(stage, ()):
            self.comm.wait(work, f"summing stage {stage}'s gradients with its replicas")
            flat.div_(self.replicas)
            if shard is not None:  # `bucket`: its place in the layout, the tensors it had
                k, present = bucket
                shard.take(k, flat, present)
                continue
            at = 0
            for i in bucket:
                p = params[i]
                n = p.numel()
                if p.grad is not None:
                    p.grad.copy_(flat[at : at + n].view_as(p.grad))
                at += n
        if shard is not None:
            for p in params:
                p.grad = None


class LossGather:
    """Rank 0's view of a step's loss: every replica's micro-batches' shares of it, in
    replica order, then the latest of their finishing times (the message `Progress.loss`
    reads)."""

    def __init__(self, sources: list[int], deliver):
        self.sources, self.deliver = sources, deliver  # job ranks of the loss stages
        self.parts: dict[int, dict[int, torch.Tensor]] = {}
        self.lock = threading.Lock()

    def add(self, step: int, source: int, message: torch.Tensor) -> None:
        with self.lock:
            parts = self.parts.setdefault(step, {})
            # Left on the device (no wait for the GPU here): `Progress.loss` reads it when there.
            parts[source] = message.double()
            if len(parts) < len(self.sources):
                return
            del self.parts[step]
        msgs = [parts[s] for s in self.sources]
        when = torch.stack([m[-1] for m in msgs]).max().reshape(1)
        self.deliver(step, torch.cat([m[:-1] for m in msgs] + [when]))


def launch_hint(plan: dict) -> str:
    """torchrun's process options for a plan: `--nproc_per_node 8`, or for a plan made for
    several nodes `--nnodes 8 --nproc_per_node 8` (plus the rendezvous options)."""
    world = Replicas.of(plan).world
    per_node = int((plan.get("cluster") or {}).get("gpus_per_node") or world)
    if per_node >= world:
        return f"--nproc_per_node {world}"
    nodes = -(-world // per_node)
    return (
        f"--nnodes {nodes} --nproc_per_node {per_node} --rdzv-backend c10d "
        "--rdzv-endpoint HOST:PORT"
    )


class StepBackwards:
    """Which backward of a stage is the last of its step, as the actions stream by: the
    backwards between a stage's S of step k - 1 and its S of step k are step k's, m of them
    (GPipe runs them in reverse: the last is the m-th run, not micro-batch m - 1's). A stage
    whose backward is split (zero-bubble: B, then W) gets its weight gradients, hence the
    all-reduce, at its W's: the executor calls the hooks at W, so the m-th W ends the step."""

    def __init__(self, micro_batches: int):
        self.m, self.seen = micro_batches, {}

    def ends_step(self, stage: int) -> bool:
        """Called at each backward (each W when split) of `stage`: is it its step's last?"""
        n = self.seen.get(stage, 0) + 1
        self.seen[stage] = n % self.m
        return n == self.m
