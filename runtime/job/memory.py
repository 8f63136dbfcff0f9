"""A rank's peak memory, as its plan counts it.

    memory_meter("cpu", dtype=torch.bfloat16)     # first call: before any stage is built
    memory_meter("cpu").peaks()                   # {"allocated": bytes, "reserved": bytes}

On CUDA, torch's caching allocator says both figures: the peak of live tensors and of what it
holds from the driver (tensors plus its cache and fragmentation). On the CPU no allocator
counts tensors, so the process's resident set does: "reserved" is its peak (the interpreter
and libraries included), "allocated" that peak less the resident set when the meter started,
before any stage was built: what the run's stages, optimizer state, activations and messages
added, the figure a plan's memory model predicts.

Torch loads much of itself only when first asked (the first optimizer imports torch._dynamo:
~70 MB resident; the first matrix product, backward and step ~15 MB more), so the meter asks
first and starts after: those are the process's, not the run's. It asks in fp32 and in the
run's dtype, with the ops a transformer block uses: a 16-bit run's first forward paged in
another 6-8 MB of kernels (file-backed) after a start that had asked in fp32 only, and its
rank peaked 4-6 MB higher (a 2-rank bf16 run of a 480-wide tied model: 168 MiB against 173).
"""

from __future__ import annotations

import resource
import sys

import torch

__all__ = ["Memory", "memory_meter", "peak_resident_bytes", "resident_bytes"]


class Memory:
    """This rank's peak memory in bytes, "allocated" (what the plan counts) and "reserved"
    (what the device holds): the module docstring says how each is measured."""

    def __init__(self, device, dtype: torch.dtype = torch.float32):
        self.device = torch.device(device)
        if self.device.type == "cuda":
            self.baseline = 0
            return
        _load_lazy_parts(dtype)
        self.baseline = resident_bytes()

    def peaks(self) -> dict[str, int]:
        if self.device.type == "cuda":
            return {
                "allocated": int(torch.cuda.max_memory_allocated(self.device)),
                "reserved": int(torch.cuda.max_memory_reserved(self.device)),
            }
        peak = peak_resident_bytes()
        return {"allocated": max(0, peak - self.baseline), "reserved": peak}


def _load_lazy_parts(dtype: torch.dtype) -> None:
    """A tiny training step in fp32 and in `dtype` (16-bit weights, fp32 masters, as
    `train.precision` keeps them): what torch loads on first use is loaded now."""
    import torch.nn.functional as F

    from ..train.optim import make_optimizer

    tokens = torch.tensor([[1, 2, 3, 4]])
    for dt in dict.fromkeys((torch.float32, dtype)):
        w = torch.nn.Parameter(torch.zeros(8, 8, dtype=dt))
        table = torch.nn.Parameter(torch.zeros(16, 8, dtype=dt))
        masters = [p.detach().float().requires_grad_() for p in (w, table)]
        optimizer = make_optimizer("adamw", masters, 1e-3)
        x = F.embedding(tokens, table)
        h = F.layer_norm(x, (8,)) + F.rms_norm(x, (8,))
        q = (h @ w).view(1, 4, 2, 4).transpose(1, 2)
        a = F.scaled_dot_product_attention(q, q, q, is_causal=True).transpose(1, 2).reshape(1, 4, 8)
        y = F.silu(a) * F.gelu(a) + F.dropout(torch.tanh(a), 0.1)
        logits = (y @ table.t()).float()
        F.cross_entropy(logits.view(-1, 16), tokens.view(-1)).backward()
        for master, p in zip(masters, (w, table)):
            master.grad = p.grad.float()
        optimizer.step()
        with torch.no_grad():
            w.copy_(masters[0])


_METERS: dict[str, Memory] = {}


def memory_meter(device: str, *, dtype: torch.dtype = torch.float32) -> Memory:
    """This process's meter for `device`, started at the first call (with the run's compute
    `dtype`; later calls' is ignored): a run makes it before its first stage is built
    (`prepare.prepare_rank`); a later plan's stages (freeze training) count from the same
    start."""
    if device not in _METERS:
        _METERS[device] = Memory(device, dtype)
    return _METERS[device]


def resident_bytes() -> int:
    """The process's resident set now (Linux: /proc; elsewhere its peak so far)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * resource.getpagesize()
    except (OSError, ValueError, IndexError):
        return peak_resident_bytes()


def peak_resident_bytes() -> int:
    """The process's peak resident set. Linux: /proc's VmHWM, this program's own; getrusage's
    ru_maxrss is not: a child started by fork or vfork and exec keeps its parent's peak at
    that moment (torchrun's agent, or pytest holding a GB, made a rank "peak" at theirs)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024  # kB
    except (OSError, ValueError, IndexError):
        pass
    peak = int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)  # KiB; bytes on macOS
    return peak if sys.platform == "darwin" else peak * 1024
