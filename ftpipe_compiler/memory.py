"""The memory model shared by the partitioners (feasibility) and the simulator (peaks).

Per GPU: weights + gradients + optimizer state of every parameter its stages own (a weight
read by several stages is owned by the first; the others receive it as an input), plus
activations: a stage that recomputes keeps only its inputs for each in-flight micro-batch
and needs its full activations for one micro-batch while it recomputes; one that does not
recompute keeps full activations for every in-flight micro-batch.
"""

from __future__ import annotations

OPTIMIZERS = ("sgd", "adam", "adamw", "adafactor")


def optimizer_state_bytes(shape: tuple[int, ...], nbytes: int, optimizer: str) -> int:
    """`optimizer_state_bytes((1024, 4096), 16 MiB, "adamw")` -> 32 MiB (two moments)."""
    if optimizer in ("adam", "adamw"):
        return 2 * nbytes
    if optimizer == "sgd":
        return 0
    if optimizer == "adafactor":
        # Factored second moment (a row and a column vector) for matrices, no momentum.
        numel = 1
        for s in shape:
            numel *= s
        itemsize = nbytes // max(numel, 1)
        if len(shape) >= 2:
            return (shape[-2] + shape[-1]) * itemsize
        return nbytes
    raise ValueError(f"unknown optimizer {optimizer!r}; choose from {', '.join(OPTIMIZERS)}")


def stage_activation_bytes(
    input_bytes: int, act_bytes: int, recompute: bool, in_flight: int
) -> tuple[int, int]:
    """(bytes held across micro-batches, transient bytes while one backward runs)."""
    if recompute:
        return in_flight * input_bytes, act_bytes
    return in_flight * act_bytes, 0


def gpu_memory_bytes(static_bytes: int, stages: list[tuple[int, int, bool, int]]) -> int:
    """Peak bytes of one GPU: static state plus held activations plus the largest transient.

    `stages` holds (input_bytes, act_bytes, recompute, in_flight) for each stage on the GPU.
    """
    held, transient = 0, 0
    for input_bytes, act_bytes, recompute, in_flight in stages:
        h, t = stage_activation_bytes(input_bytes, act_bytes, recompute, in_flight)
        held += h
        transient = max(transient, t)
    return static_bytes + held + transient
