"""Measure this machine's links and optimizer step once, for its hardware file.

    python -m benchmarks.calibrate                    # print the fitted figures
    python -m benchmarks.calibrate --write cpu        # and store them in cpu.json

What the simulator charges and where it comes from (`configs/hardware/<name>.json`):
- `link_bandwidth`, `link_latency_s`: a point-to-point message of n bytes between two ranks
  takes latency + n / bandwidth. Measured by gloo ping-pong between two local one-thread ranks
  (`harness.gloo`, 4 KiB to 49 MiB), `rounds` times; the fastest one-way time per size (other
  processes only slow a message down) is fitted by `fit`.
- `optimizer_bandwidth`, `optimizer_cache_bandwidth`, `cache_bytes`: an optimizer step reads
  and writes each parameter's weights, gradient and optimizer state once
  (`formulas.optimizer_step_s`), its several passes from the last-level cache when they
  fit there (`cache_bytes`, from sysfs), else from memory. Measured by timing what the
  runtime does at a step (`Stepper`: clip by the gradient norm, step, clear; the norm's
  all-reduce apart) on one thread, fastest of `steps`: 16 block-sized tensors, and one
  embedding-sized one.

- `peak_flops_16bit`: what bf16 and fp16 math reach against fp32's `peak_flops`, by the
  ratio of one thread's `MATMUL` x `MATMUL` matmul times (fastest of `matmul_runs`), with the
  date and the CPU's 16-bit flags (`avx512_bf16`, `amx_bf16`, `avx512_fp16`, ...) beside
  it: a CPU without bf16 instructions runs a bf16 matmul tens of times slower than fp32,
  and a plan costed at the fp32 rate would be that optimistic.
  `--only matmul` measures and stores this part alone.

- the `host` section (optimizer offload: `ftpipe_compiler.costs.host`): `step_bandwidth`,
  the bytes of masters, summed gradients and AdamW state the runtime's offloaded step (torch's
  AdamW on CPU tensors, fused as `make_optimizer` makes it) steps per second on all of this
  machine's cores (its node's rate; one thread's beside it), over `host_rates.HOST_TENSORS` tensors of
  `HOST_NUMEL` fp32 elements (beyond the cache, as a large stage's are), fastest of
  `host_runs`; `sum_bandwidth`, a bf16 gradient's landing buffer added into its fp32 sum
  (`precision.add_grad`); `link_bandwidth` = `node_bandwidth`, a gradient copied into its
  landing buffer (on this machine the "GPU" is the host: the link is a copy in memory);
  `memory_bytes`, this machine's memory (/proc/meminfo). `--only host` measures and stores
  this part alone.

- the node section's `intra_node` link (the data-parallel all-reduce): `latency_s` and the
  bandwidth each buffer size reaches, `allreduce_bandwidth`. 2 ranks all-reduce 1 to 100 MB
  (`allreduce.bench`) `allreduce_runs` times; each size's median is fitted by `fit` for the
  latency, and each size's bandwidth is what remains of its time after it.

Run it on a quiet machine: other processes on the same cores make everything look slower.
"""

from __future__ import annotations

import argparse
import datetime
import json
import re
import statistics
import time
from pathlib import Path

import ftpipe_runtime

from benchmarks.host_rates import measure_host

ftpipe_runtime.prepare_process()  # before torch loads: the CPU allocator a run uses

ROOT = Path(__file__).resolve().parents[1]  # the repository
SMALL = (256, 1024)  # a transformer block's matrix: its step stays in cache
LARGE = (50257, 256)  # GPT-2's embedding: its step streams from memory
MATMUL = 1024  # the side of the square matmul that compares 16-bit math with fp32
SIXTEEN_BIT = ("bfloat16", "float16")


def fit(rows, times) -> tuple[float, float]:
    """(latency_s, bandwidth) of t = k * latency + n / bandwidth over rows (k, n) and their
    times t: k latencies (1 for a message, 2(d-1) for a ring all-reduce) and n bytes through
    the link. Least squares on relative error (each equation divided by its t, so small and
    large messages count alike). A negative latency means no fixed cost is visible: the
    bandwidth is then fitted alone, with latency 0 (the best fit a latency >= 0 allows)."""
    a11 = a12 = a22 = b1 = b2 = 0.0  # normal equations in (latency, 1 / bandwidth)
    for (k, n), t in zip(rows, times):
        x1, x2 = k / t, n / t
        a11, a12, a22 = a11 + x1 * x1, a12 + x1 * x2, a22 + x2 * x2
        b1, b2 = b1 + x1, b2 + x2
    det = a11 * a22 - a12 * a12
    latency = (b1 * a22 - b2 * a12) / det
    inverse = (a11 * b2 - a12 * b1) / det
    if latency < 0:
        latency, inverse = 0.0, b2 / a22
    return latency, 1 / inverse


def measure_link(rounds: int, work: Path) -> dict:
    from benchmarks.harness.gloo import measure_link as ping_pong

    runs = [ping_pong(work / f"round{i}") for i in range(rounds)]
    sizes = runs[0]["sizes"]
    # The fastest of the runs: other processes on these cores only ever slow a message.
    times = [min(r["one_way_s"][i] for r in runs) for i in range(len(sizes))]
    latency, bandwidth = fit([(1, n) for n in sizes], times)
    return {"sizes": sizes, "one_way_s": times, "link_latency_s": latency,
            "link_bandwidth": bandwidth}  # fmt: skip


def measure_step(optimizer: str, steps: int) -> dict:
    """What a step streams per second for parameters whose step stays in the last-level
    cache (`SMALL` tensors) and for one that streams from memory (a `LARGE` tensor)."""
    cache = last_level_cache_bytes()
    out = {"optimizer": optimizer, "cache_bytes": cache}
    for name, shape, count in (("cache", SMALL, 16), ("memory", LARGE, 1)):
        step_s, held = time_step(optimizer, shape, count, steps)
        out[f"{name}_step_s"] = step_s
        out[f"{name}_bandwidth"] = 2 * held / step_s
    return out


def time_step(optimizer: str, shape, count: int, steps: int) -> tuple[float, int]:
    """(median seconds of the runtime's step over `count` tensors of `shape`, bytes held)."""
    import torch
    from ftpipe_runtime.train.optim import clip_coef, make_optimizer, squared_norm

    from ftpipe_compiler.costs.formulas import param_bytes

    torch.set_num_threads(1)  # as one rank runs
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(shape) * 0.02) for _ in range(count)]
    opt = make_optimizer(optimizer, params, lr=1e-4)
    times = []
    for i in range(steps + 1):
        for p in params:
            p.grad = torch.randn_like(p) * 1e-3
        start = time.perf_counter()
        grads = [p.grad for p in params]  # the runtime's clipping (stepping.Stepper)
        coef = clip_coef(squared_norm(grads), 1.0)
        for g in grads:
            g.mul_(coef)
        opt.step()
        for p in params:
            p.grad = None
        if i:  # the first step makes the optimizer state
            times.append(time.perf_counter() - start)
    held = count * sum(param_bytes(shape, "float32", True, optimizer))
    return min(times), held  # the least disturbed by other processes


def last_level_cache_bytes() -> int:
    """The largest CPU cache (Linux sysfs), 0 when unknown."""
    sizes = []
    for f in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        text = f.read_text().strip()
        scale = {"K": 2**10, "M": 2**20, "G": 2**30}.get(text[-1:], 1)
        sizes.append(int(text.rstrip("KMG")) * scale)
    return max(sizes, default=0)


def measure_matmul(runs: int) -> dict:
    """Seconds of one thread's MATMUL x MATMUL matmul in fp32 and each 16-bit dtype (the
    fastest of `runs`), and the CPU's flags naming 16-bit math."""
    import torch

    torch.set_num_threads(1)  # as one rank runs
    out = {"n": MATMUL, "flags": sixteen_bit_flags()}
    for name in ("float32", *SIXTEEN_BIT):
        a, b = (torch.randn(MATMUL, MATMUL).to(getattr(torch, name)) for _ in range(2))
        a @ b  # warm
        times = []
        for _ in range(runs):
            start = time.perf_counter()
            a @ b
            times.append(time.perf_counter() - start)
        out[f"{name}_s"] = min(times)
    return out


def sixteen_bit_flags() -> list[str]:
    """The CPU's instruction-set flags with bf16 or fp16 in their name (Linux), sorted."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return []
    flags = next((line.split(":", 1)[1].split() for line in text.splitlines()
                  if line.startswith("flags")), [])  # fmt: skip
    return sorted({f for f in flags if "bf16" in f or "fp16" in f})


def sixteen_bit_peaks(peak_flops: float, matmul: dict) -> dict:
    """`peak_flops_16bit`: fp32's peak scaled by how much faster (or slower) each 16-bit
    dtype's matmul ran."""
    fp32 = matmul["float32_s"]
    return {name: float(f"{peak_flops * fp32 / matmul[f'{name}_s']:.3g}") for name in SIXTEEN_BIT}


def measure_allreduce(runs: int, work: Path) -> dict:
    """2 ranks' all-reduce, each size's median of `runs` runs: the latency `fit` finds, and
    the bandwidth each size reaches after it (ring: 2(d-1)/d of the bytes cross each link)."""
    from benchmarks.allreduce.bench import SIZES, ring_factor, run_ranks  # it imports `fit`

    per_run = [run_ranks(work, 2, SIZES, f"-{i}") for i in range(runs)]
    median = [statistics.median(ts) for ts in zip(*per_run)]
    latency, _ = fit([(2, ring_factor(2) * n) for n in SIZES], median)
    curve = [[n, round(ring_factor(2) * n / (t - 2 * latency), -6)] for n, t in zip(SIZES, median)]
    return {"runs": per_run, "median": median, "latency_s": latency, "curve": curve}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--write", metavar="HARDWARE", help="store the figures in this file")
    ap.add_argument("--rounds", type=int, default=5, help="ping-pong runs (fastest per size)")
    ap.add_argument("--steps", type=int, default=10, help="optimizer steps timed")
    ap.add_argument("--optimizer", default="adamw")
    ap.add_argument("--allreduce-runs", type=int, default=5, help="all-reduce runs (median)")
    ap.add_argument("--matmul-runs", type=int, default=5, help="matmuls per dtype (fastest)")
    ap.add_argument("--host-runs", type=int, default=5, help="offloaded steps timed (fastest)")
    ap.add_argument("--only", choices=["matmul", "host"], help="measure and store only this part")
    ap.add_argument("--work", default=str(ROOT / "out" / "calibrate"))
    args = ap.parse_args(argv)
    path = ROOT / "configs" / "hardware" / f"{args.write}.json" if args.write else None
    hw = json.loads(path.read_text()) if path else None  # a bad name fails before measuring
    work = Path(args.work)
    matmul = measure_matmul(args.matmul_runs) if args.only in (None, "matmul") else None
    host = measure_host(args.host_runs) if args.only in (None, "host") else None
    if args.only is None:
        link = measure_link(args.rounds, work)
        step = measure_step(args.optimizer, args.steps)
        allreduce = measure_allreduce(args.allreduce_runs, work)
        print(json.dumps({"link": link, "step": step, "allreduce": allreduce}, indent=1))
    print(json.dumps({"matmul": matmul, "host": host}, indent=1))
    if path:
        from ftpipe_runtime.atomic import write_atomic

        if args.only is None:
            _store(hw, args, link, step, allreduce)
        if matmul is not None:
            _store_matmul(hw, args, matmul)
        if host is not None:
            _store_host(hw, args, host)
        text = json.dumps(hw, indent=2)  # one [bytes, bandwidth] pair per line:
        write_atomic(path, re.sub(r"\[\s+(\S+),\s+(\S+)\s+\]", r"[\1, \2]", text) + "\n")
        print(f"wrote {path}")


def _store(hw: dict, args, link: dict, step: dict, allreduce: dict) -> None:
    hw["link_bandwidth"] = float(f"{link['link_bandwidth']:.3g}")
    hw["link_latency_s"] = float(f"{link['link_latency_s']:.3g}")
    hw["optimizer_bandwidth"] = float(f"{step['memory_bandwidth']:.3g}")
    hw["optimizer_cache_bandwidth"] = float(f"{step['cache_bandwidth']:.3g}")
    hw["cache_bytes"] = step["cache_bytes"]
    intra = hw["node"]["intra_node"]
    intra["latency_s"] = round(allreduce["latency_s"], 7)
    intra["allreduce_bandwidth"] = allreduce["curve"]
    note = (
        "point-to-point link and optimizer step measured on this machine by "
        "python -m benchmarks.calibrate: gloo ping-pong between two one-thread ranks "
        f"(4 KiB to 49 MiB, fastest of {args.rounds} runs) fitted to "
        f"{hw['link_latency_s'] * 1e6:.0f} us + bytes / {hw['link_bandwidth'] / 1e9:.2f} GB/s; "
        f"the runtime's {args.optimizer} step with gradient clipping on one thread, "
        f"fastest of {args.steps}: 16 x {SMALL} fp32 parameters "
        f"{step['cache_step_s'] * 1e3:.1f} ms, one {LARGE} {step['memory_step_s'] * 1e3:.1f} "
        f"ms: {hw['optimizer_cache_bandwidth'] / 1e9:.1f} GB/s of weights, gradients and "
        f"state read and written while a parameter's step fits the "
        f"{step['cache_bytes'] // 2**20} MiB cache, {hw['optimizer_bandwidth'] / 1e9:.1f} "
        "GB/s beyond"
    )
    hw["sources"] = [s for s in hw.get("sources", []) if not s.startswith(note[:40])]
    hw["sources"].append(note)


def _store_matmul(hw: dict, args, matmul: dict) -> None:
    hw["peak_flops_16bit"] = sixteen_bit_peaks(hw["peak_flops"], matmul)
    n, fp32 = matmul["n"], matmul["float32_s"]
    slower = ", ".join(f"{name} {matmul[f'{name}_s'] / fp32:.0f}x" for name in SIXTEEN_BIT)
    flags = ", ".join(matmul["flags"]) or "none"
    note = (
        f"16-bit rates measured by python -m benchmarks.calibrate on {datetime.date.today()}: "
        f"a {n} x {n} matmul on one thread (fastest of {args.matmul_runs}) took "
        f"{fp32 * 1e3:.0f} ms in fp32; {slower} slower; the CPU's bf16/fp16 flags: {flags}; "
        "peak_flops_16bit is peak_flops scaled by those ratios"
    )
    hw["sources"] = [s for s in hw.get("sources", []) if not s.startswith(note[:30])]
    hw["sources"].append(note)


def _store_host(hw: dict, args, host: dict) -> None:
    """The node's figures into the `host` section: each the better of one thread and all the
    cores (on a shared machine other processes may hold the other cores), both in the note."""
    every, one = host[f"threads_{host['cores']}"], host["threads_1"]
    best = {k: max(every[k], one[k]) for k in one}
    section = hw.setdefault("host", {})
    section["step_bandwidth"] = float(f"{best['step_bandwidth']:.3g}")
    section["sum_bandwidth"] = float(f"{best['sum_bandwidth']:.3g}")
    section["link_bandwidth"] = section["node_bandwidth"] = float(f"{best['copy_bandwidth']:.3g}")
    if host["memory_bytes"]:
        section["memory_bytes"] = host["memory_bytes"]
    section["device_is_host"] = True
    n, runs = host["numel"], args.host_runs
    note = (
        f"host (optimizer offload) measured by python -m benchmarks.calibrate on "
        f"{datetime.date.today()}: the runtime's offloaded AdamW step (fused: {host['fused']}) "
        f"over {host['tensors']} x {n:,} fp32 elements, fastest of {runs}: one thread "
        f"{one['step_s'] * 1e3:.0f} ms = {one['step_bandwidth'] / 1e9:.2f} GB/s of masters, "
        f"gradients and state, {host['cores']} threads {every['step_bandwidth'] / 1e9:.2f} GB/s; "
        f"a bf16 gradient added into its fp32 sum {one['sum_bandwidth'] / 1e9:.2f} and "
        f"{every['sum_bandwidth'] / 1e9:.2f} GB/s of bytes passed over; the landing copy (the "
        f"link: the device is the host, a copy in memory) {one['copy_bandwidth'] / 1e9:.2f} and "
        f"{every['copy_bandwidth'] / 1e9:.2f} GB/s; the better of each pair stored; "
        "memory_bytes: /proc/meminfo's MemTotal"
    )
    hw["sources"] = [s for s in hw.get("sources", []) if not s.startswith(note[:30])]
    hw["sources"].append(note)


if __name__ == "__main__":
    main()
