"""A Llama-3.2-1B-shaped model (random weights) in 2 stages on one GPU, in bf16: the step
time against the simulator's, planned against measured peak memory (allocated and
reserved), how busy the GPU was (torch.profiler's kernels over a step), and which attention
kernel ran (SDPA: flash, memory-efficient, cuDNN or the math fallback)."""

from __future__ import annotations

from ..packages import compiled, hardware_for
from ..registry import Check, Findings, part
from ..timing import peak_bytes, reset_peak

# SDPA's implementations, by the op torch dispatches to (CPU and GPU alike) and by the
# device kernels each launches (names as CUDA reports them: the first match wins).
ATTENTION_OPS = {
    "flash": "_scaled_dot_product_flash_attention",
    "efficient": "_scaled_dot_product_efficient_attention",
    "cudnn": "_scaled_dot_product_cudnn_attention",
    "math": "_scaled_dot_product_attention_math",
}
ATTENTION_KERNELS = {"flash": ("flash",), "efficient": ("fmha", "efficient", "mem_eff"),
                     "cudnn": ("cudnn", "sdpa")}  # fmt: skip


def compile_args(s, hardware: str) -> list[str]:
    """`ftpipe compile` arguments of the Llama-shaped package (costed for `hardware`)."""
    return [
        "-m", s.llama_model, "-g", "2", "-p", "even-layers", "--schedule", "1f1b",
        "--dtype", s.llama_dtype, "--seq-len", str(s.llama_seq),
        "--micro-batch", str(s.llama_micro_batch), "--batch", str(s.llama_batch),
        "--hardware", hardware,
    ]  # fmt: skip


def llama_package(check: Check):
    """The 2-stage package of the Llama-shaped model (shared with the eager comparison)."""
    return compiled(check, "llama", compile_args(check.sizes, hardware_for(check.device)))


def simulated_one_gpu(plan: dict):
    """The simulator's run of a one-rank plan (every stage on GPU 0) under 1F1B."""
    from ftpipe_compiler.plan import Plan
    from ftpipe_compiler.simulate import simulate

    return simulate(Plan.from_dict(plan), "1f1b", int(plan["micro_batches"]), steps=10)


def attention_seen(events) -> dict:
    """{"ops": {implementation: calls}, "kernels": {implementation: launches}} of a profile."""
    ops, kernels = {}, {}
    for e in events:
        name = e.name()
        if e.device_type().name == "CPU":
            for impl, op in ATTENTION_OPS.items():
                if op in name and "backward" not in name:
                    ops[impl] = ops.get(impl, 0) + 1
        else:
            low = name.lower()
            impl = next((i for i, keys in ATTENTION_KERNELS.items()
                         if any(k in low for k in keys)), None)  # fmt: skip
            if impl is not None and ("attention" in low or "fmha" in low or "flash" in low):
                kernels[impl] = kernels.get(impl, 0) + 1
    return {"ops": ops, "kernels": kernels}


def busy_fraction(events, window_start_ns: int) -> float | None:
    """The share of the time from `window_start_ns` to the last kernel's end that some kernel
    ran on the GPU (None: no kernel)."""
    spans = sorted(
        (e.start_ns(), e.start_ns() + e.duration_ns())
        for e in events
        if e.device_type().name == "CUDA" and e.start_ns() >= window_start_ns
    )
    if not spans:
        return None
    busy, (start, end) = 0, spans[0]
    first = start
    for a, b in spans[1:]:
        if a > end:
            busy, start, end = busy + end - start, a, b
        else:
            end = max(end, b)
    busy += end - start
    return busy / max(end - first, 1)


@part("llama", "Llama-3.2-1B-shaped, 2 stages on one GPU, bf16", cuda_s=150, cpu_s=60,
      needs=("compiler", "transformers"))  # fmt: skip
def llama(check: Check, found: Findings) -> None:
    import torch

    from ftpipe_compiler.costs.hardware import get_hardware

    s, dev = check.sizes, check.device
    pkg = llama_package(check)
    plan = pkg.one_rank()
    m = int(plan["micro_batches"])
    hw = hardware_for(dev)
    sim = simulated_one_gpu(plan)
    found["compile_args"] = compile_args(s, hw)
    found.update(model=s.llama_model, stages=len(plan["stages"]), dtype=s.llama_dtype,
                 seq_len=s.llama_seq, micro_batch=s.llama_micro_batch, micro_batches=m,
                 hardware=hw, efficiency=get_hardware(hw).efficiency,
                 compile_s=pkg.compile_s, simulated_step_s=sim.step_time_s,
                 planned_peak_bytes=sim.gpus[0].peak_memory_bytes)  # fmt: skip
    argv = ["--device", dev, "--dtype", s.llama_dtype, "--decay", "constant", "--schedule",
            "1f1b"]  # fmt: skip

    reset_peak(dev)
    summary = pkg.run(plan, [*argv, "--steps", str(s.llama_steps)], check.work / "llama")
    samples = m * s.llama_micro_batch
    found["measured_step_s"] = samples / summary["steady_samples_per_s"]
    found["losses"] = summary["losses"]
    found["step_ratio_measured_to_simulated"] = found["measured_step_s"] / sim.step_time_s
    peak = peak_bytes(dev)
    if peak:
        found["measured_peak_bytes"] = peak
        planned = found["planned_peak_bytes"]
        found["allocated_to_planned"] = peak["allocated"] / planned
        found.expect(peak["allocated"] <= 1.2 * planned,
                     f"allocated {peak['allocated'] / 2**30:.2f} GiB, planned "
                     f"{planned / 2**30:.2f} GiB: the memory model misses "
                     f"{(peak['allocated'] - planned) / 2**30:.2f} GiB")  # fmt: skip

    activities = [torch.profiler.ProfilerActivity.CPU]
    if dev == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        pkg.run(plan, [*argv, "--steps", "2"], check.work / "llama-profiled")
    events = list(prof.profiler.kineto_results.events())
    found["attention"] = seen = attention_seen(events)
    found.expect(bool(seen["ops"]), "no scaled_dot_product_attention ran")
    step1 = [e.start_ns() for e in events if e.name() == f"ftpipe 0F{m}"]
    if dev == "cuda" and step1:
        found["gpu_busy_fraction"] = busy_fraction(events, min(step1))
