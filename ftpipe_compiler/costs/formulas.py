"""The one cost and memory model: a GPU's period (FTPipe eq. 1) and a GPU's peak memory.

    period_s(compute_s=0.4, send_s=0.1, recv_s=0.5)          # 0.5: the receive is not hidden
    weight, state = param_bytes((1024, 4096), "float32", trainable=True, optimizer="adamw")
    held, transient = stage_memory(trainable_bytes=w, frozen_bytes=0, state_bytes=s,
                                   input_bytes=i, act_bytes=a, policy=policy)
    gpu_memory_bytes([(held, transient), ...])                # held summed, largest transient
    ring_allreduce_s(nbytes=2**30, replicas=8, bandwidth=40e9, latency_s=1e-5)

Every partitioner, `Plan`, the planner and the simulator call these; partitioners may cache
or batch the calls (the functions are plain arithmetic, so numpy arrays pass through), never
write the formulas again. What a stage keeps comes from its schedule's `StagePolicy` (the
runtime's statement): trainable weights times the versions kept, gradients and optimizer
state once (frozen parameters have neither), and activations: a stage that recomputes keeps
only its inputs for each in-flight micro-batch and needs its full activations for one
micro-batch while it recomputes; one that does not recompute keeps full activations for
every in-flight micro-batch. A split backward (zero-bubble) keeps a micro-batch in flight
until its W, and a recomputing stage keeps the rebuilt activations of the `deferred`
micro-batches whose B ran and W has not. Bytes per element come from a `Precision`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from ftpipe_runtime.precision import PRECISIONS as RUNTIME_PRECISIONS

OPTIMIZERS = ("sgd", "adam", "adamw", "adafactor")


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
        """The sizes of a runtime precision (`ftpipe_runtime.precision`: what training does)."""
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
    """`optimizer_state_elements((1024, 4096), "adamw")` -> 2 * 1024 * 4096 (two moments)."""
    numel = math.prod(shape)
    if optimizer in ("adam", "adamw"):
        return 2 * numel
    if optimizer == "sgd":
        return 0
    if optimizer == "adafactor":
        # Factored second moment (a row and a column vector) for matrices, no momentum.
        return shape[-2] + shape[-1] if len(shape) >= 2 else numel
    raise ValueError(f"unknown optimizer {optimizer!r}; choose from {', '.join(OPTIMIZERS)}")


def param_bytes(
    shape: tuple[int, ...],
    dtype: str,
    trainable: bool,
    optimizer: str,
    precision: Precision = FP32,
) -> tuple[int, int]:
    """(bytes of one copy of the weight, bytes of its gradient and optimizer state). Tensors
    in the precision's compute dtype take its sizes; others (integer position ids, an fp32
    island of a 16-bit model such as T5's `wo` under fp16) their own dtype's, with a gradient
    and optimizer state of that size and no master copy."""
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
    return weight, numel * (precision.grad + precision.master) + state


def stage_memory(
    *, trainable_bytes, frozen_bytes, state_bytes, input_bytes, act_bytes, policy
) -> tuple:
    """(bytes a stage holds throughout, bytes it needs on top while one backward runs)."""
    static = trainable_bytes * policy.weight_versions + frozen_bytes + state_bytes
    if policy.recompute:
        kept = policy.deferred * act_bytes if policy.split else 0 * act_bytes
        return static + policy.in_flight * input_bytes + kept, act_bytes
    return static + policy.in_flight * act_bytes, 0 * act_bytes


def gpu_memory_bytes(stages) -> int:
    """Peak bytes of one GPU from its stages' (held, transient): one backward runs at a time."""
    held = transient = 0
    for h, t in stages:
        held += h
        transient = max(transient, t)
    return held + transient


def ring_allreduce_s(
    nbytes: float, replicas: int, bandwidth: float, latency_s: float = 0.0
) -> float:
    """A ring all-reduce of `nbytes` among `replicas` ranks over links of `bandwidth`: each
    rank sends (and receives) 2(d-1) chunks of nbytes/d, one latency each."""
    if replicas <= 1 or nbytes <= 0:
        return 0.0
    d = replicas
    return 2 * (d - 1) / d * nbytes / bandwidth + 2 * (d - 1) * latency_s


def optimizer_step_s(held_bytes, hardware) -> float:
    """An optimizer step over parameters each holding `held_bytes` (weights, gradient and
    optimizer state, as `param_bytes` counts them): elementwise and memory-bound, it reads
    and writes each once, at the hardware's step bandwidth for a parameter of that size
    (`Hardware.step_bandwidth`: its passes stay in cache or stream from memory)."""
    return sum(2 * b / hardware.step_bandwidth(b) for b in held_bytes if b > 0)


def period_s(compute_s: float, send_s: float, recv_s: float) -> float:
    """FTPipe eq. 1 for a GPU: its compute plus the transfer time compute does not hide."""
    return compute_s + max(0.0, send_s - compute_s) + max(0.0, recv_s - compute_s)
