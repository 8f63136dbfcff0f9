"""The one cost and memory model: a GPU's period (FTPipe eq. 1) and a GPU's peak memory.

    period_s(compute_s=0.4, send_s=0.1, recv_s=0.5)          # 0.5: the receive is not hidden
    weight, state = param_bytes((1024, 4096), "float32", trainable=True, optimizer="adamw")
    weight, state = param_bytes(shape, "bfloat16", True, "adamw", bf16, sharded_over=2)  # ZeRO-1
    held, transient = stage_memory(trainable_bytes=w, frozen_bytes=0, state_bytes=s,
                                   input_bytes=i, act_bytes=a, policy=policy)
    gpu_memory_bytes([(held, transient), ...])                # held summed, largest transient
    posted_bytes([8192] * 4 + [2**23], ahead_bytes=2**28, most=64)  # receive buffers posted ahead
    MemoryReserve(context_bytes=2**29, communicator_bytes=2**26, fragmentation=0.05).bytes(t, 3)
    ring_allreduce_s(nbytes=2**30, replicas=8, bandwidth=40e9, latency_s=1e-5)
    ring_s(nbytes=2**30, replicas=8, bandwidth=40e9, passes=1)   # a reduce-scatter or all-gather

Every partitioner, `Plan`, the planner and the simulator call these; partitioners may cache
or batch the calls (the functions are plain arithmetic, so numpy arrays pass through), never
write the formulas again. What a stage keeps comes from its schedule's `StagePolicy` (the
runtime's statement): trainable weights times the copies the runtime holds (`weight_copies`),
gradients and optimizer state once (frozen parameters have neither), and activations: a stage that recomputes keeps
only its inputs for each in-flight micro-batch and needs its full activations for one
micro-batch while it recomputes; one that does not recompute keeps full activations for
every in-flight micro-batch. A split backward (zero-bubble) keeps a micro-batch in flight
until its W, and a recomputing stage keeps the rebuilt activations of the `deferred`
micro-batches whose B ran and W has not. Bytes per element come from a `Precision`. What a GPU
holds beyond its stages (messages, receive buffers, the device's own reserve) is added up by
`gpu_memory.gpu_memory` from a plan, with `posted_bytes` and `MemoryReserve` from here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from ftpipe_runtime.errors import unknown_name
from ftpipe_runtime.train.optim import OPTIMIZERS as RUNTIME_OPTIMIZERS
from ftpipe_runtime.train.precision import PRECISIONS as RUNTIME_PRECISIONS

OPTIMIZERS = tuple(RUNTIME_OPTIMIZERS)  # the runtime's update rules, in its order
ACTIVATIONS_ON_GPU = 2  # offloaded activations: the micro-batch in flight and one prefetched


@dataclass(frozen=True)
class Precision:
    """Bytes per element of what training keeps, for tensors in the compute dtype."""

    name: str
    weight: int  # each version of a weight
    grad: int  # its gradient (the sum over a step's micro-batches)
    state: int  # each optimizer-state element
    master: int = 0  # a full-precision copy beside low-precision weights; 0: none
    compute: str = "float32"  # the stages' dtype: tensors traced in another keep their own

    @classmethod
    def of(cls, runtime) -> Precision:
        """The sizes of a runtime precision (`ftpipe_runtime.train.precision`: what training does)."""
        b = runtime.bytes_per_element()
        return cls(runtime.name, b["weight"], b["grad"], b["state"], b["master"], runtime.compute)


# fp32 4 + 4 + 4 per state element; bf16 / fp16 mixed 2 + 4 + 4 master + 4; bf16-pure 2 + 2 + 2.
PRECISIONS = {name: Precision.of(p) for name, p in RUNTIME_PRECISIONS.items()}
FP32 = PRECISIONS["fp32"]


def describe(precision: Precision, hardware=None) -> str:
    """One line on what a precision keeps per trainable parameter, and where its math runs."""
    p = precision
    kept = f"{p.weight} B weight + {p.grad} B gradient"
    kept += f" + {p.master} B fp32 master" if p.master else ""
    line = f"precision {p.name}: {kept} per parameter, {p.state} B per optimizer-state element"
    if hardware is not None and p.compute != "float32":
        peak = hardware.peak(p.compute)
        slow = " (no tensor cores for it: the fp32 rate)" if peak <= hardware.fp32_peak() else ""
        line += f"; {p.compute} math at {peak / 1e12:.1f} TFLOP/s on {hardware.name}{slow}"
    return line


def optimizer_state_elements(shape: tuple[int, ...], optimizer: str) -> int:
    """`optimizer_state_elements((1024, 4096), "adamw")` -> 2 * 1024 * 4096 (two moments): the
    runtime's own count (`ftpipe_runtime.train.optim.OPTIMIZERS`)."""
    try:
        rule = RUNTIME_OPTIMIZERS[optimizer]
    except KeyError:
        raise ValueError(unknown_name("optimizer", optimizer, OPTIMIZERS)) from None
    return rule.state_elements(tuple(shape))


def param_bytes(
    shape: tuple[int, ...],
    dtype: str,
    trainable: bool,
    optimizer: str,
    precision: Precision = FP32,
    sharded_over: int = 1,
) -> tuple[int, int]:
    """(bytes of one copy of the weight, bytes of its gradient and optimizer state). Tensors
    in the precision's compute dtype take its sizes; others (integer position ids, an fp32
    island of a 16-bit model such as T5's `wo` under fp16) their own dtype's, with a gradient
    and optimizer state of that size and no master copy.

    `sharded_over` d > 1: its stage's optimizer state is sharded across d replicas
    (ZeRO-1, `ftpipe_runtime.train.zero`): the gradient still sums whole on every replica,
    and each keeps 1/d of the masters and optimizer state — the masters then a copy apart
    from the weights even where the weights are their own (fp32, bf16-pure: each replica
    steps its chunk and all-gathers it into the weights). The runtime's alignment padding
    (a few elements a tensor) is not counted."""
    numel = math.prod(shape)
    torch_dtype = getattr(torch, dtype)
    size = torch.empty((), dtype=torch_dtype).element_size()
    if not torch_dtype.is_floating_point:
        return numel * size, 0
    if dtype != precision.compute:
        precision = Precision(dtype, weight=size, grad=size, state=size, compute=dtype)
    weight = numel * precision.weight
    if not trainable:
        return weight, 0
    state = optimizer_state_elements(shape, optimizer) * precision.state
    if sharded_over > 1:
        master = precision.master or precision.weight
        return weight, numel * precision.grad + -(-(numel * master + state) // sharded_over)
    return weight, numel * (precision.grad + precision.master) + state


def weight_copies(policy) -> int:
    """Copies of a stage's trainable weights the runtime holds at once. A schedule that pins
    versions (`weight_delay` > 0: PipeDream-2BW, WPipe) keeps `weight_versions` of them (the
    paper's count, the live weights among them), and one more where the stage holds several
    micro-batches in flight and keeps their graphs (no recompute, or a split backward): it
    then starts a step's forwards before it takes the step before, and the executor sets the
    version they read aside at their first use, a copy of the live weights until that step
    replaces them (a recomputing stage's forwards read the live weights, `Versions.use`)."""
    keeps_graph = not policy.recompute or policy.split
    ahead = bool(policy.weight_delay) and policy.in_flight > 1 and keeps_graph
    return policy.weight_versions + ahead


def stage_memory(
    *, trainable_bytes, frozen_bytes, state_bytes, input_bytes, act_bytes, policy, offload=None,
    device_sums=0,
) -> tuple:  # fmt: skip
    """(bytes a stage holds throughout, bytes it needs on top while one backward runs).
    `offload` (`costs.host.Offload`, what the stage keeps on the host): its optimizer, and the
    GPU holds no master or optimizer state, and no gradient sum unless it sums its gradients
    on the device (`offload.sums_on_device`: `device_sums` bytes, `host.device_sum_bytes`);
    its activations, and the GPU holds what it keeps for a backward (activations, or inputs
    where it recomputes) for at most `ACTIVATIONS_ON_GPU` micro-batches."""
    if offload is not None and offload.optimizer:
        state_bytes = 0 * state_bytes + (device_sums if offload.sums_on_device else 0)
    in_flight = policy.in_flight
    if offload is not None and offload.activations:
        in_flight = min(in_flight, ACTIVATIONS_ON_GPU)
    static = trainable_bytes * weight_copies(policy) + frozen_bytes + state_bytes
    if policy.recompute:
        kept = policy.deferred * act_bytes if policy.split else 0 * act_bytes
        return static + in_flight * input_bytes + kept, act_bytes
    return static + in_flight * act_bytes, 0 * act_bytes


def gpu_memory_bytes(stages) -> int:
    """Peak bytes of one GPU from its stages' (held, transient): one backward runs at a time."""
    held = transient = 0
    for h, t in stages:
        held += h
        transient = max(transient, t)
    return held + transient


def posted_bytes(sizes, ahead_bytes: int, most: int, held=None) -> int:
    """Bytes of receive buffers one source's messages keep posted ahead of need, by the
    runtime's rule (`ftpipe_runtime.engine.comm.Comm.post_ahead`): after each receive the next
    messages are posted while fewer than `ahead_bytes` wait (so one message more than the
    window when it falls short), at most `most` of them. `sizes`: one step's messages in
    sending order, repeating; the most that waits after any receive. `held`: what each
    message's posted buffer holds meanwhile, where not its size (on a CPU a buffer's pages
    are mapped as its message lands)."""
    n = len(sizes)
    if not n or most < 1:
        return 0
    held = sizes if held is None else held
    stream = [(sizes[i % n], held[i % n]) for i in range(n + most)]  # windows starting in a step
    best = waiting = kept = end = 0  # the window [start, end): its end moves on as its start does
    for start in range(n):
        end = max(end, start)
        while end - start < most and waiting < ahead_bytes:
            waiting, kept = waiting + stream[end][0], kept + stream[end][1]
            end += 1
        best = max(best, kept)
        if end > start:
            waiting, kept = waiting - stream[start][0], kept - stream[start][1]
    return best


@dataclass(frozen=True)
class MemoryReserve:
    """What a device holds besides the run's tensors (`memory_reserve` of a hardware file):
    its context (CUDA's, before any tensor), one communicator per process group it is in
    (NCCL: buffers per peer), and what the caching allocator holds beyond the live tensors,
    as a fraction of them (fragmentation). A CPU rank has none of these, but its messages
    (gloo's) report delivery only when waited for, so the runtime holds what it sent until
    a step waits for it (`sends_held`); NCCL's are let go as they complete."""

    context_bytes: int = 0
    communicator_bytes: int = 0
    fragmentation: float = 0.0
    sends_held: bool = False

    def bytes(self, tensor_bytes, communicators: int):
        """The reserve of a device holding `tensor_bytes` of tensors in `communicators` groups."""
        fixed = self.context_bytes + communicators * self.communicator_bytes
        return fixed + self.fragmentation * tensor_bytes

    def usable(self, capacity: int, communicators: int) -> int:
        """The tensor bytes that fit in `capacity` beside the reserve."""
        fixed = self.context_bytes + communicators * self.communicator_bytes
        return max(0, int((capacity - fixed) / (1 + self.fragmentation)))


def ring_allreduce_s(
    nbytes: float, replicas: int, bandwidth: float, latency_s: float = 0.0
) -> float:
    """A ring all-reduce of `nbytes` among `replicas` ranks over links of `bandwidth`: each
    rank sends (and receives) 2(d-1) chunks of nbytes/d, one latency each."""
    return ring_s(nbytes, replicas, bandwidth, latency_s, passes=2)


def ring_s(
    nbytes: float, replicas: int, bandwidth: float, latency_s: float = 0.0, passes: int = 1
) -> float:
    """`passes` trips of `nbytes` round a ring of `replicas` ranks: each rank sends (and
    receives) (d-1) chunks of nbytes/d a pass, one latency each. One pass is a
    reduce-scatter (of the whole `nbytes`) or an all-gather (into the whole); two are an
    all-reduce."""
    if replicas <= 1 or nbytes <= 0:
        return 0.0
    d = replicas
    return passes * ((d - 1) / d * nbytes / bandwidth + (d - 1) * latency_s)


def optimizer_step_s(held_bytes, hardware) -> float:
    """An optimizer step over parameters each holding `held_bytes` (weights, gradient and
    optimizer state, as `param_bytes` counts them): elementwise and memory-bound, it reads
    and writes each once, at the hardware's step bandwidth for a parameter of that size
    (`Hardware.step_bandwidth`: its passes stay in cache or stream from memory)."""
    return sum(2 * b / hardware.step_bandwidth(b) for b in held_bytes if b > 0)


def period_s(compute_s: float, send_s: float, recv_s: float, *, maximum=max) -> float:
    """FTPipe eq. 1 for a GPU: its compute plus the transfer time compute does not hide.
    `maximum=np.maximum` counts arrays of them (partition/chain.py's segment tables)."""
    return compute_s + maximum(0.0, send_s - compute_s) + maximum(0.0, recv_s - compute_s)
