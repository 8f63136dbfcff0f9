"""The figures a hardware file's roofline rests on, measured: matrix products in bf16, fp32
and TF32, the device's memory bandwidth, host<->device copies, the cost of one small op, and
the runtime's optimizer step. The report's calibration section proposes them for the
hardware file (`python -m benchmarks.gpu_check.apply`).
"""

from __future__ import annotations

from ..registry import Check, Findings, part
from ..timing import sync, timed


def gemm_tflops(device: str, n: int, dtype, tf32: bool) -> float:
    """TFLOP/s of an n x n x n product (random inputs), TF32 on or off for fp32."""
    import torch
    from ftpipe_runtime.job.device import use_tf32

    use_tf32(torch.device(device), tf32)
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    seconds = timed(device, lambda: torch.mm(a, b), repeats=10, warmup=3)
    use_tf32(torch.device(device), True)  # the runtime's default again
    return 2 * n**3 / seconds / 1e12


def copy_bandwidth(device: str, nbytes: int) -> float:
    """Bytes/s read and written by a device-to-device copy (both counted)."""
    import torch

    src = torch.empty(nbytes // 4, device=device, dtype=torch.float32).fill_(1.0)
    dst = torch.empty_like(src)
    return 2 * nbytes / timed(device, lambda: dst.copy_(src), repeats=10, warmup=2)


def host_bandwidth(nbytes: int) -> dict:
    """Bytes/s from pinned host memory to the GPU and back."""
    import torch

    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    h2d = timed("cuda", lambda: dev.copy_(host, non_blocking=True), repeats=5, warmup=1)
    d2h = timed("cuda", lambda: host.copy_(dev, non_blocking=True), repeats=5, warmup=1)
    return {"host_to_device": nbytes / h2d, "device_to_host": nbytes / d2h}


def op_overhead_s(device: str, launches: int) -> float:
    """Seconds of one tiny op (an in-place add to one number): launch and dispatch alone."""
    import time

    import torch

    x = torch.zeros(1, device=device)
    for _ in range(100):
        x.add_(1.0)
    sync(device)
    t0 = time.perf_counter()
    for _ in range(launches):
        x.add_(1.0)
    sync(device)
    return (time.perf_counter() - t0) / launches


def optimizer_bandwidth(device: str, numel: int) -> float:
    """Bytes/s the runtime's AdamW step streams (weights, gradient, two moments, read and
    written once: `formulas.optimizer_step_s`) over one parameter of `numel` fp32 elements."""
    import torch
    from ftpipe_runtime.train.optim import make_optimizer

    p = torch.nn.Parameter(torch.randn(numel, device=device) * 0.02)
    p.grad = torch.randn_like(p) * 1e-3
    opt = make_optimizer("adamw", [p], lr=1e-4)
    seconds = timed(device, opt.step, repeats=5, warmup=2)
    return 2 * 4 * numel * 4 / seconds


@part("rates", "Matrix, memory, host and per-op rates (calibration)", cuda_s=45, cpu_s=30)
def rates(check: Check, found: Findings) -> None:
    import torch

    s, dev = check.sizes, check.device
    found["gemm_n"] = s.gemm_n
    found["gemm_tflops"] = {
        "bfloat16": gemm_tflops(dev, s.gemm_n, torch.bfloat16, True),
        "float32": gemm_tflops(dev, s.gemm_n, torch.float32, False),
        "tf32": gemm_tflops(dev, s.gemm_n, torch.float32, True),
    }
    found["copy_bytes"] = s.copy_bytes
    found["memory_bandwidth"] = copy_bandwidth(dev, s.copy_bytes)
    found["op_overhead_s"] = op_overhead_s(dev, s.op_launches)
    found["optimizer_bandwidth"] = optimizer_bandwidth(dev, s.copy_bytes // 16)
    if dev == "cuda":
        found["host_bytes"] = s.host_bytes
        found.update(host_bandwidth(s.host_bytes))
        from benchmarks.host_rates import measure_host

        # the offload model's CPU side (the host's AdamW step and gradient sums), on this host
        found["host"] = measure_host(runs=3)
        g = found["gemm_tflops"]
        found.expect(g["tf32"] > 2 * g["float32"], "TF32 products ran no faster than fp32 ones")
