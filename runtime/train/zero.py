"""Sharded optimizer state across replicas (ZeRO-1): with d data-parallel replicas, each keeps
the master weights and optimizer state of 1/d of its stage's trainable elements
(`--shard-optimizer`, or `"shard_optimizer": true` on a plan's stage).

    mixed = MixedPrecision(precision, modules, sharded={stage})   # no fp32 copies of values
    opt = ShardedOptimizer(mixed, stage, replicas=2, index=0, optimizer="adamw", lr=1e-3)
    opt.bind(comm, group)          # the stage's replicas (GradSync does it)
    opt.take(k, chunk, present)    # bucket k's mean gradient, this rank's chunk (GradSync)
    opt.step(); mixed.after_step(stage)   # this rank's slice stepped, then all-gathered
    full = opt.gather()            # collective: every slice, whole (checkpoints, freezing)
    opt.load_state_dict(state); opt.load_masters(tensors)   # this rank's slice of whole ones

Layout. The stage's trainable tensors (`MixedPrecision.trainable`) are cut into the buckets
the replicas' gradient sums use (`replicas.bucket_indices`: at most 25 MiB, the last
parameters first, one master dtype each), a bucket's tensors flattened one after the other,
each starting at a multiple of `ALIGN` elements, and padded with zeros to d equal chunks of
such multiples. Replica i (its place among the stage group's sorted ranks) owns the i-th
chunk of every bucket, so a bucket is reduce-scattered as soon as the backward is done with
it, as an unsharded one is all-reduced (Megatron's distributed optimizer shards its buckets
alike). A tensor's part of a replica's chunk is a `Piece`; the
optimizer steps the pieces, views into this rank's master chunk of each bucket, grouped for
weight decay by the tensor they come from (`optim.param_groups`: matrices decayed, biases
and norm weights not). The alignment makes every cut in a tensor fall where torch's fused CPU
kernels cut the whole tensor into vectors, so a slice's elements are stepped by the same
instructions as the whole's: cut elsewhere, fused AdamW rounds a few elements of a slice one
ulp away from the whole tensor's (measured: 1 to 3 elements of a 36-element slice in 30% of
trials; none with cuts at multiples of 16 floats).

A step. The gradients still sum over the step's micro-batches in full fp32 tensors (a 16-bit
weight's in a gradient-only stand-in for its master: `MixedPrecision(sharded=...)`); at the
step's last backward each bucket is reduce-scattered, at the stage's step each replica holds
the replicas' mean gradient of its chunk (the full gradients are freed), clips by the norm
over every shard (`replica_norms`: the shards' squared norms summed over the replicas),
steps its pieces, and every bucket's chunks are all-gathered in the weights' dtype (cast
before the gather: the same rounding as after, half the bytes in bf16) into every replica's
weights. Only update rules that treat each element alone step a slice as they step the whole
(`SHARDABLE`: SGD, Adam, AdamW); Adafactor's factored state needs whole matrices.

Bytes a replica sends per step for N trainable elements (weights of w bytes each), as ring
algorithms move them: unsharded, the all-reduce of the fp32 gradients 2 (d-1)/d 4N; sharded,
the reduce-scatter (d-1)/d 4N and the all-gather (d-1)/d wN: as much in fp32, 3/4 of it in
bf16 (`Comm` counts them in `sent`). Kept per replica: 12N/d bytes of fp32 masters and AdamW
state instead of 12N under bf16 (fp32 weights are their own masters: 8N of state unsharded).

Checkpoints keep their format (one file set per stage, written by the first replica):
`gather` puts the replicas' slices together bucket by bucket on the host, as the fp32 masters
by name and the optimizer state as the unsharded optimizer's `state_dict` holds it;
`load_state_dict` and `load_masters` take this rank's slices of those. A checkpoint saved
with or without sharding, on any number of replicas, resumes either way.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import torch

from .optim import Hyper, make_optimizer
from .replicas import BUCKET_BYTES, bucket_indices

__all__ = [
    "ALIGN",
    "SHARDABLE",
    "Bucket",
    "Gathered",
    "Piece",
    "ShardedOptimizer",
    "layout",
    "replica_norms",
]

# The optimizers a slice can step as the whole would: each element's update reads only that
# element's gradient and state. Their state tensors shaped like the parameter (besides `step`).
SHARDABLE = {"sgd": (), "adam": ("exp_avg", "exp_avg_sq"), "adamw": ("exp_avg", "exp_avg_sq")}
# Where a tensor starts in its bucket, and what a chunk is a multiple of, in elements: cuts
# at multiples of 16 floats step bit for bit as the whole tensor (measured, AVX2); 32 leaves
# room for wider vectors (AVX-512 holds 16 floats, 32 bf16).
ALIGN = 32


@dataclass(frozen=True)
class Bucket:
    members: tuple[int, ...]  # positions in the stage's trainable tensors, in flat order
    offsets: tuple[int, ...]  # each member's first element in the flat bucket (aligned)
    numel: int  # the end of the last member
    chunk: int  # elements each replica owns (aligned): d of them hold the bucket
    dtype: torch.dtype  # the masters' (and their gradients')
    gathered: torch.dtype  # the weights' where they share one, else the masters'


@dataclass(frozen=True)
class Piece:
    """A trainable tensor's part of this rank's chunk of a bucket."""

    name: str
    member: int  # position in the stage's trainable tensors
    bucket: int
    start: int  # its first element in the tensor (flattened)
    length: int
    at: int  # its first element in the chunk


def layout(tensors, weights, replicas: int, limit: int = BUCKET_BYTES) -> list[Bucket]:
    """The buckets of `tensors` (the stage's trainable tensors; `weights`: the weights they
    are the masters of) for `replicas` shards (see the module doc)."""
    by_dtype: dict[torch.dtype, list[int]] = {}
    for i, t in enumerate(tensors):
        by_dtype.setdefault(t.dtype, []).append(i)
    out = []
    for dtype, where in by_dtype.items():
        sizes = [tensors[i].numel() * tensors[i].element_size() for i in where]
        for bucket in bucket_indices(sizes, limit):
            members = tuple(where[j] for j in bucket)
            counts = [tensors[i].numel() for i in members]
            offsets = tuple(itertools.accumulate((_aligned(n) for n in counts[:-1]), initial=0))
            numel = offsets[-1] + counts[-1]
            chunk = _aligned(-(-numel // replicas))
            kinds = {weights[i].dtype for i in members}
            gathered = kinds.pop() if len(kinds) == 1 else dtype
            out.append(Bucket(members, offsets, numel, chunk, dtype, gathered))
    return out


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


@dataclass
class Gathered:
    """A sharded stage's state put together (`ShardedOptimizer.gather`), on the host."""

    masters: dict[str, torch.Tensor]  # name -> the whole master
    state: dict[str, dict]  # name -> its optimizer state, whole (the stepped tensors only)
    order: list[str]  # the unsharded optimizer's parameters by index
    groups: list[dict]  # ... and its param_groups

    def state_dict(self) -> dict:
        """The optimizer state as the unsharded optimizer's `state_dict` holds it."""
        state = {i: self.state[n] for i, n in enumerate(self.order) if n in self.state}
        return {"state": state, "param_groups": self.groups}


class ShardedOptimizer:
    """A stage's optimizer over this replica's slice of it (see the module doc); in the run's
    `optimizers` in place of the stage's torch optimizer. `index`: this rank's place among
    the stage's replicas' sorted ranks."""

    def __init__(
        self,
        mixed,
        stage: int,
        *,
        replicas: int,
        index: int,
        optimizer: str,
        lr: float,
        hyper: Hyper | None = None,
    ):
        self.mixed, self.stage, self.replicas, self.index = mixed, stage, replicas, index
        self.optimizer, self.lr, self.hyper = optimizer.lower(), lr, hyper or Hyper()
        self.keys = SHARDABLE[self.optimizer]
        self.comm, self.group = None, ()
        self._build()
        mixed.shards[stage] = self

    def bind(self, comm, group) -> None:
        """The collectives with the stage's replicas: `comm` over job ranks `group`."""
        self.comm, self.group = comm, tuple(sorted(group))

    @torch.no_grad()
    def _build(self) -> None:
        """The layout over the stage's trainable tensors, its master chunks from the weights
        (as `MixedPrecision` takes its masters), and the optimizer over the pieces."""
        named = self.mixed.trainable(self.stage)
        weights = [w for _, w in self.mixed.weights(self.stage)]
        self.names = [n for n, _ in named]
        self.shapes = [tuple(t.shape) for _, t in named]
        self.buckets = layout([t for _, t in named], weights, self.replicas)
        self.masters: list[torch.Tensor] = []  # per bucket: this rank's chunk
        self.pieces: list[tuple[Piece, torch.Tensor]] = []  # each with the tensor stepped
        self._in: list[list[tuple[Piece, torch.Tensor]]] = []  # the same, by bucket
        decayed: dict[int, bool] = {}
        for k, b in enumerate(self.buckets):
            chunk = torch.zeros(b.chunk, dtype=b.dtype, device=weights[b.members[0]].device)
            lo, mine = self.index * b.chunk, []
            for i, off in zip(b.members, b.offsets, strict=True):
                first, end = max(lo, off), min(lo + b.chunk, off + weights[i].numel())
                if first >= end:
                    continue
                piece = Piece(self.names[i], i, k, first - off, end - first, first - lo)
                view = chunk[piece.at : piece.at + piece.length]
                view.copy_(
                    weights[i].detach().reshape(-1)[piece.start : piece.start + piece.length]
                )
                t = view.detach().requires_grad_(True)  # a leaf on the chunk's storage
                decayed[id(t)] = len(self.shapes[i]) >= 2
                mine.append((piece, t))
            self.masters.append(chunk)
            self._in.append(mine)
            self.pieces += mine
        self.inner = make_optimizer(
            self.optimizer, [t for _, t in self.pieces], self.lr, self.hyper,
            decays=lambda t: decayed[id(t)],
        )  # fmt: skip

    # --- the optimizer's face (Stepper, Saver, checkpoints) ---
    @property
    def param_groups(self) -> list[dict]:
        return self.inner.param_groups if self.inner is not None else []

    @property
    def state(self) -> dict:
        return self.inner.state if self.inner is not None else {}

    def named(self) -> list[tuple[str, torch.Tensor]]:
        """(name, piece) of what this rank steps: `MixedPrecision.stepped`."""
        return [(p.name, t) for p, t in self.pieces]

    def step(self) -> None:
        if self.inner is not None:
            self.inner.step()

    def master_bytes(self) -> int:
        return sum(m.nbytes for m in self.masters)

    # --- a step ---
    def flat(self, k: int, grads: list[torch.Tensor]) -> torch.Tensor:
        """Bucket k's tensors' gradients (flattened, in its order) laid out whole, padding
        zero: what the replicas reduce-scatter."""
        b = self.buckets[k]
        out = grads[0].new_zeros(b.chunk * self.replicas)
        for g, off in zip(grads, b.offsets, strict=True):
            out[off : off + g.numel()] = g
        return out

    def take(self, k: int, chunk: torch.Tensor, present: set[int]) -> None:
        """Bucket k's mean gradient, this rank's chunk of it, into its pieces' `.grad`; a
        tensor that had no gradient this step (not in `present`) is not stepped, as the
        unsharded optimizer skips it."""
        for piece, t in self._in[k]:
            in_step = piece.member in present
            t.grad = chunk[piece.at : piece.at + piece.length] if in_step else None

    @torch.no_grad()
    def publish(self) -> None:
        """The stepped slices into every replica's weights: each bucket's chunks all-gathered
        in the weights' dtype, the next bucket's gather in flight while one is copied out."""
        weights = [w for _, w in self.mixed.weights(self.stage)]
        pending = None
        for k, b in enumerate(self.buckets):
            whole = self.masters[k].new_empty(b.chunk * self.replicas, dtype=b.gathered)
            work = self.comm.all_gather_async(whole, self.masters[k].to(b.gathered), self.group)
            if pending is not None:
                self._unpack(*pending, weights)
            pending = (work, whole, b)
        if pending is not None:
            self._unpack(*pending, weights)

    def _unpack(self, work, whole: torch.Tensor, b: Bucket, weights) -> None:
        self.comm.wait(work, f"gathering stage {self.stage}'s weights from its replicas")
        for i, off in zip(b.members, b.offsets, strict=True):
            w = weights[i]
            w.copy_(whole[off : off + w.numel()].view_as(w))

    # --- whole state: checkpoints and freezing ---
    @torch.no_grad()
    def gather(self) -> Gathered:
        """Every replica's slices put together on the host (collective: every replica of the
        stage calls it), bucket by bucket: the masters, each tensor's optimizer state (its
        elementwise tensors, and its step count from whichever replica holds a piece)."""
        masters, state, d, width = {}, {}, self.replicas, 1 + len(self.keys)
        for k, b in enumerate(self.buckets):
            mine = self.masters[k].new_zeros(width * b.chunk)
            mine[: b.chunk] = self.masters[k]
            steps = torch.zeros(len(b.members), dtype=torch.float64, device=mine.device)
            slot = {i: j for j, i in enumerate(b.members)}
            for piece, t in self._in[k]:
                held = self.state.get(t)
                if not held:
                    continue
                steps[slot[piece.member]] = float(held.get("step", 1))
                for j, key in enumerate(self.keys, 1):
                    at = j * b.chunk + piece.at
                    mine[at : at + piece.length] = held[key].reshape(-1)
            every = self._gathered(mine).view(d, width, b.chunk).transpose(0, 1)
            flat = every.reshape(width, d * b.chunk)[:, : b.numel].cpu()
            counts = self._gathered(steps).view(d, -1).amax(0).tolist()
            for j, (i, off) in enumerate(zip(b.members, b.offsets, strict=True)):
                name, shape, n = self.names[i], self.shapes[i], math.prod(self.shapes[i])
                masters[name] = flat[0, off : off + n].reshape(shape).clone()
                if counts[j] > 0:
                    held = {"step": torch.tensor(counts[j], dtype=torch.float32)}
                    for x, key in enumerate(self.keys, 1):
                        held[key] = flat[x, off : off + n].reshape(shape).clone()
                    state[name] = held
        order, groups = self._unsharded()
        return Gathered(masters, state, order, groups)

    def _gathered(self, mine: torch.Tensor) -> torch.Tensor:
        whole = mine.new_empty(mine.numel() * self.replicas)
        work = self.comm.all_gather_async(whole, mine, self.group, kind="optimizer state")
        self.comm.wait(work, f"gathering stage {self.stage}'s optimizer state from its replicas")
        return whole

    def _unsharded(self) -> tuple[list[str], list[dict]]:
        """The unsharded optimizer's parameters (by name) in its index order, and its
        param_groups, at this rank's learning rate: what its state_dict would say."""
        named = self.mixed.trainable(self.stage)
        ref = make_optimizer(self.optimizer, [t for _, t in named], self.lr, self.hyper)
        if ref is None:
            return [], []
        by_id = {id(t): n for n, t in named}
        order = [by_id[id(t)] for g in ref.param_groups for t in g["params"]]
        groups = ref.state_dict()["param_groups"]
        for g in groups:
            g["lr"] = self.param_groups[0]["lr"] if self.param_groups else self.lr
        return order, groups

    def load_state_dict(self, state_dict: dict) -> None:
        """This rank's slices of an unsharded optimizer state (a checkpoint's)."""
        order, _ = self._unsharded()
        indices = [i for g in state_dict.get("param_groups", ()) for i in g["params"]]
        if len(indices) != len(order):
            raise ValueError(
                f"its optimizer state is of {len(indices)} tensors, stage {self.stage} trains "
                f"{len(order)}"
            )
        self._load_named({order[int(i)]: s for i, s in state_dict.get("state", {}).items()})

    @torch.no_grad()
    def load_masters(self, tensors: dict) -> None:
        """This rank's slices of whole masters (a checkpoint's tensors, by name)."""
        for piece, t in self.pieces:
            if piece.name not in tensors:
                raise KeyError(f"{piece.name} is not in the checkpoint")
            t.copy_(tensors[piece.name].reshape(-1)[piece.start : piece.start + piece.length])

    def _load_named(self, by_name: dict[str, dict]) -> None:
        """Whole per-tensor states (name -> state) into the pieces, by the optimizer's own
        `load_state_dict` (which puts each tensor where it keeps it)."""
        if self.inner is None:
            return
        params = [t for g in self.inner.param_groups for t in g["params"]]
        index = {id(t): i for i, t in enumerate(params)}
        state = {}
        for piece, t in self.pieces:
            held = by_name.get(piece.name)
            if held is None:
                continue
            end = piece.start + piece.length
            state[index[id(t)]] = {
                key: v.reshape(-1)[piece.start : end].clone() if key in self.keys else v.clone()
                for key, v in held.items()
            }
        groups = self.inner.state_dict()["param_groups"]
        self.inner.load_state_dict({"state": state, "param_groups": groups})

    def relayout(self) -> None:
        """After freezing (`MixedPrecision.freeze`): the layout made again over the tensors
        that still train, their masters and state carried over (collective)."""
        whole = self.gather()
        self._build()
        self.load_masters(whole.masters)
        self._load_named(whole.state)


def replica_norms(comm, whole, part, ranks, replicas: int, what: str) -> torch.Tensor:
    """Squared gradient norms summed over `ranks` (a pipeline's GPUs): `whole`, the same on
    every replica (unsharded stages' mean gradients), and `part`, this replica's shards',
    which only the sum over every replica's ranks completes. With sharding both travel in
    one all-reduce over the replicas too, `whole` then counted once."""
    if replicas == 1:
        return comm.all_reduce(whole + part, ranks, what)
    both = torch.stack([whole, part])
    comm.all_reduce(both, ranks, what, replicas=True)
    return both[0] / replicas + both[1]
