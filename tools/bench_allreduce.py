"""Section `allreduce`: gloo all-reduce on this machine against the simulator's ring model.

    python tools/bench.py --sections allreduce --out /tmp/allreduce.md
    torchrun --nproc_per_node 4 tools/bench_allreduce.py --result r.json   # the worker

2 and 4 local CPU ranks (one thread each) sum float32 tensors of 1 to 100 MB with
`dist.all_reduce`, as the runtime's gradient buckets do; each size is timed `repeats` times
after a warm-up and the fastest kept (other processes share this machine's cores: the
fastest is the least disturbed). The simulator charges a data-parallel all-reduce of B
bytes over d replicas 2(d-1)/d * B / bandwidth + 2(d-1) * latency (a ring: every rank sends
and receives 2(d-1) chunks of B/d). `configs/hardware/cpu.json`'s node section holds the
figures `fit` (least squares on relative error) found for 2 ranks, one per core of this
machine; 4 ranks share 2 cores, so their times measure CPU contention as much as the
links, and are shown, not held to the target. `markdown` reports each size's error.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

from ftpipe_runtime.atomic import write_atomic

MB = 1_000_000
SIZES = (1 * MB, 4 * MB, 16 * MB, 64 * MB, 100 * MB)
REPEATS = (20, 10, 6, 4, 3)
RANKS = (2, 4)
CORES = os.cpu_count() or 1  # the target holds for ranks that each have a core


def time_allreduce(nbytes: int, repeats: int) -> float:
    """Fastest seconds of one blocking all-reduce of `nbytes` on every rank (rank 0's clock)."""
    import torch
    import torch.distributed as dist

    buf = torch.ones(nbytes // 4, dtype=torch.float32)
    dist.all_reduce(buf)  # warm-up: connections and buffers
    times = []
    for _ in range(repeats):
        dist.barrier()
        start = time.perf_counter()
        dist.all_reduce(buf)
        times.append(time.perf_counter() - start)
    return min(times)


def worker(argv=None) -> None:
    import torch.distributed as dist

    ap = argparse.ArgumentParser(description="gloo all-reduce times per message size")
    ap.add_argument("--result", required=True)
    ap.add_argument("--sizes", default=",".join(map(str, SIZES)))
    args = ap.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",")]
    repeats = [REPEATS[SIZES.index(s)] if s in SIZES else 5 for s in sizes]
    dist.init_process_group("gloo")
    times = [time_allreduce(n, r) for n, r in zip(sizes, repeats)]
    if int(os.environ["RANK"]) == 0:
        write_atomic(args.result, json.dumps({"sizes": sizes, "seconds": times}))
    dist.barrier()
    dist.destroy_process_group()


def ring_factor(ranks: int) -> float:
    return 2 * (ranks - 1) / ranks


def fit(points) -> tuple[float, float]:
    """(bandwidth B/s, latency s) minimising the squared relative error of
    t = ring_factor(d) * bytes / bandwidth + 2(d-1) * latency over (d, bytes, t) points."""
    # Weighted least squares in (1/bandwidth, latency): rows scaled by 1/t (relative error).
    a11 = a12 = a22 = b1 = b2 = 0.0
    for d, nbytes, t in points:
        x1, x2 = ring_factor(d) * nbytes / t, 2 * (d - 1) / t
        a11, a12, a22 = a11 + x1 * x1, a12 + x1 * x2, a22 + x2 * x2
        b1, b2 = b1 + x1, b2 + x2
    det = a11 * a22 - a12 * a12
    inv_bw = (b1 * a22 - b2 * a12) / det
    latency = (a11 * b2 - a12 * b1) / det
    if latency < 0:  # no fixed cost visible: bandwidth alone
        inv_bw, latency = b1 / a11, 0.0
    return 1.0 / inv_bw, latency


def measure(work: Path | None = None, ranks=RANKS, sizes=SIZES) -> dict:
    import tempfile

    from bench_launch import TOOLS, torchrun

    from ftpipe_compiler.cluster import get_cluster
    from ftpipe_compiler.cost_model import ring_allreduce_s

    work = Path(work or tempfile.mkdtemp(prefix="ftpipe-allreduce-"))
    work.mkdir(parents=True, exist_ok=True)
    measured = {}
    for d in ranks:
        result = work / f"allreduce-{d}.json"
        args = [
            TOOLS / "bench_allreduce.py",
            "--result",
            result,
            "--sizes",
            ",".join(map(str, sizes)),
        ]
        torchrun(args, work / f"allreduce-{d}.log", nproc=d)
        measured[d] = json.loads(result.read_text())["seconds"]
    link = get_cluster("cpu", gpus=max(ranks)).intra_node
    rows = []
    for d in ranks:
        for nbytes, t in zip(sizes, measured[d]):
            sim = ring_allreduce_s(nbytes, d, link.bandwidth, link.latency_s)
            rows.append({"ranks": d, "bytes": nbytes, "measured_s": t, "simulated_s": sim,
                         "error": sim / t - 1})  # fmt: skip
    bw, lat = fit([(r["ranks"], r["bytes"], r["measured_s"]) for r in rows])
    return {
        "link": {"name": link.name, "bandwidth": link.bandwidth, "latency_s": link.latency_s},
        "refit": {"bandwidth": bw, "latency_s": lat},
        "rows": rows,
        "max_abs_error": max(abs(r["error"]) for r in rows if r["ranks"] <= CORES),
    }


def markdown(data: dict) -> str:
    link = data["link"]
    lines = [
        "## Data-parallel all-reduce: gloo on this machine vs the simulator",
        "",
        "`dist.all_reduce` of float32 tensors among 2 and 4 local CPU ranks (one thread each), "
        "fastest of several runs, against the simulator's ring model 2(d-1)/d x bytes / "
        f"bandwidth + 2(d-1) x latency with `configs/hardware/cpu.json`'s figures "
        f"({link['bandwidth'] / 1e9:.2f} GB/s, {link['latency_s'] * 1e6:.0f} us, fitted once to "
        "2 ranks on this 2-core machine and stored; 4 ranks oversubscribe the cores).",
        "",
        "| ranks | MB | measured ms | simulated ms | error |",
        "|---:|---:|---:|---:|---:|",
    ]
    for r in data["rows"]:
        lines.append(
            f"| {r['ranks']} | {r['bytes'] / MB:.0f} | {r['measured_s'] * 1e3:.1f} | "
            f"{r['simulated_s'] * 1e3:.1f} | {r['error']:+.1%} |"
        )
    refit = data["refit"]
    lines += [
        "",
        f"Largest error with one rank per core: {data['max_abs_error']:.1%} (target: within "
        "20% from 1 to 100 MB). "
        f"Refitted on this run: {refit['bandwidth'] / 1e9:.2f} GB/s, "
        f"{refit['latency_s'] * 1e6:.0f} us.",
        "",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    worker()
