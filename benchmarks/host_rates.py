"""The host's rates for optimizer offload (`ftpipe_compiler.costs.host`), measured on the
machine this runs on: `benchmarks.calibrate --only host` stores them for the CPU, and the GPU
check measures them on a GPU's host.

    from benchmarks.host_rates import measure_host
    measure_host(runs=3)["threads_16"]["step_bandwidth"]   # bytes/s of the offloaded step

Importing it changes nothing in the process (`calibrate` prepares its CPU allocator first)."""

from __future__ import annotations

import time
from pathlib import Path

__all__ = ["HOST_NUMEL", "HOST_TENSORS", "measure_host", "memory_total_bytes"]

HOST_NUMEL = 8 * 2**20  # elements of one offloaded tensor: 32 MiB in fp32, beyond the cache
HOST_TENSORS = 4


def measure_host(runs: int) -> dict:
    """The offloaded step's, gradient sum's and landing copy's rates (see the module doc), and
    beside the sum's (`precision.add_into`, a chunk at a time) the same sum as one ATen add."""
    import os

    import torch
    from ftpipe_runtime.train.optim import make_optimizer
    from ftpipe_runtime.train.precision import PRECISIONS, add_grad

    from ftpipe_compiler.costs.host import host_step_bytes, host_sum_bytes

    out = {"numel": HOST_NUMEL, "tensors": HOST_TENSORS, "cores": os.cpu_count() or 1}
    shape, fp32 = (HOST_NUMEL,), PRECISIONS["fp32"]
    step_bytes = HOST_TENSORS * host_step_bytes(shape, "float32", "adamw", fp32)
    sum_bytes = host_sum_bytes(shape, "bfloat16", PRECISIONS["bf16"])
    torch.manual_seed(0)
    for threads in sorted({1, out["cores"]}):
        torch.set_num_threads(threads)
        masters = [torch.randn(HOST_NUMEL).requires_grad_(True) for _ in range(HOST_TENSORS)]
        opt = make_optimizer("adamw", masters, lr=1e-4)
        out["fused"] = bool(opt.defaults.get("fused"))
        step = []
        for i in range(runs + 1):
            for m in masters:
                m.grad = torch.randn_like(m) * 1e-3
            start = time.perf_counter()
            opt.step()
            if i:  # the first step makes the state
                step.append(time.perf_counter() - start)
        landing = torch.randn(HOST_NUMEL).to(torch.bfloat16)
        device_grad = torch.randn(HOST_NUMEL)
        buf = torch.empty(HOST_NUMEL)
        sums, whole, copies = [], [], []
        for _ in range(runs):
            start = time.perf_counter()
            add_grad(masters[0], landing)  # the sum exists after the first: an add in place
            sums.append(time.perf_counter() - start)
            start = time.perf_counter()
            masters[0].grad.add_(landing)  # one ATen add: an fp32 copy of it all first
            whole.append(time.perf_counter() - start)
            start = time.perf_counter()
            buf.copy_(device_grad)
            copies.append(time.perf_counter() - start)
        out[f"threads_{threads}"] = {
            "step_s": min(step),
            "step_bandwidth": step_bytes / min(step),
            "sum_bandwidth": sum_bytes / min(sums),
            # the same sum as the runtime made it before `precision.add_into`, to compare
            "sum_whole_bandwidth": sum_bytes / min(whole),
            "copy_bandwidth": 4 * HOST_NUMEL / min(copies),
        }
    out["memory_bytes"] = memory_total_bytes()
    return out


def memory_total_bytes() -> int:
    """This machine's memory (Linux /proc/meminfo), 0 when unknown."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0
