"""Measure this machine's point-to-point link and optimizer step once, for its hardware file.

    python -m benchmarks.calibrate                    # print the fitted figures
    python -m benchmarks.calibrate --write cpu        # and store them in cpu.json

What the simulator charges and where it comes from (`configs/hardware/<name>.json`):
- `link_bandwidth`, `link_latency_s`: a point-to-point message of n bytes between two ranks
  takes latency + n / bandwidth. Measured by gloo ping-pong between two local one-thread ranks
  (`bench_gloo`, 4 KiB to 49 MiB), `rounds` times; the fastest one-way time per size (other
  processes only slow a message down) is fitted by least squares on relative error (small
  and large messages count alike).
- `optimizer_bandwidth`, `optimizer_cache_bandwidth`, `cache_bytes`: an optimizer step reads
  and writes each parameter's weights, gradient and optimizer state once
  (`formulas.optimizer_step_s`), its several passes from the last-level cache when they
  fit there (`cache_bytes`, from sysfs), else from memory. Measured by timing what the
  runtime does at a step (`Stepper`: clip by the gradient norm, step, clear; the norm's
  all-reduce apart) on one thread, fastest of `steps`: 16 block-sized tensors, and one
  embedding-sized one.

The node section (the data-parallel all-reduce, `bench_allreduce`) is left as it is. Run it
on a quiet machine: other processes on the same cores make everything look slower.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]  # the repository
SMALL = (256, 1024)  # a transformer block's matrix: its step stays in cache
LARGE = (50257, 256)  # GPT-2's embedding: its step streams from memory


def fit_link(sizes, times) -> tuple[float, float]:
    """(latency_s, bandwidth) minimising sum(((a + n/b) - t) / t)^2): weighted least squares."""
    w = [1 / t for t in times]  # relative error: each equation divided by its time
    rows = [(wi, n * wi) for n, wi in zip(sizes, w)]  # unknowns a, c = 1/b
    saa = sum(r[0] * r[0] for r in rows)
    sac = sum(r[0] * r[1] for r in rows)
    scc = sum(r[1] * r[1] for r in rows)
    sat = sum(r[0] * t * wi for r, t, wi in zip(rows, times, w))
    sct = sum(r[1] * t * wi for r, t, wi in zip(rows, times, w))
    det = saa * scc - sac * sac
    a = (sat * scc - sct * sac) / det
    c = (saa * sct - sac * sat) / det
    return max(a, 0.0), 1 / c


def measure_link(rounds: int, work: Path) -> dict:
    from benchmarks.harness.gloo import measure_link as ping_pong

    runs = [ping_pong(work / f"round{i}") for i in range(rounds)]
    sizes = runs[0]["sizes"]
    # The fastest of the runs: other processes on these cores only ever slow a message.
    times = [min(r["one_way_s"][i] for r in runs) for i in range(len(sizes))]
    latency, bandwidth = fit_link(sizes, times)
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
    from ftpipe_runtime.optim import clip_coef, make_optimizer, squared_norm

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


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--write", metavar="HARDWARE", help="store the figures in this file")
    ap.add_argument("--rounds", type=int, default=5, help="ping-pong runs (fastest per size)")
    ap.add_argument("--steps", type=int, default=10, help="optimizer steps timed")
    ap.add_argument("--optimizer", default="adamw")
    ap.add_argument("--work", default=str(ROOT / "out" / "calibrate"))
    args = ap.parse_args(argv)
    link = measure_link(args.rounds, Path(args.work))
    step = measure_step(args.optimizer, args.steps)
    print(json.dumps({"link": link, "step": step}, indent=1))
    if args.write:
        from ftpipe_runtime.atomic import write_atomic

        path = ROOT / "configs" / "hardware" / f"{args.write}.json"
        hw = json.loads(path.read_text())
        hw["link_bandwidth"] = float(f"{link['link_bandwidth']:.3g}")
        hw["link_latency_s"] = float(f"{link['link_latency_s']:.3g}")
        hw["optimizer_bandwidth"] = float(f"{step['memory_bandwidth']:.3g}")
        hw["optimizer_cache_bandwidth"] = float(f"{step['cache_bandwidth']:.3g}")
        hw["cache_bytes"] = step["cache_bytes"]
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
        write_atomic(path, json.dumps(hw, indent=2) + "\n")
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
