"""Section `allreduce`: gloo all-reduce on this machine against the simulator's ring model.

    python -m benchmarks --sections allreduce --out /tmp/allreduce.md
    python -m benchmarks.allreduce.bench --calibrate 5   # measure this machine, store in cpu.json
    torchrun --nproc_per_node 4 -m benchmarks.allreduce.bench --result r.json   # the worker

2 and 4 local CPU ranks (one thread each) sum float32 tensors of 1 to 100 MB with
`dist.all_reduce`, as the runtime's gradient buckets do. The sizes are timed in rounds, one
all-reduce of each size per round, and each size's fastest round kept: other processes
share this machine's cores, the fastest is the least disturbed, and interleaving spreads a
disturbance over all sizes instead of one. The simulator charges a data-parallel
all-reduce of B bytes over d replicas 2(d-1)/d * B / bandwidth(B) + 2(d-1) * latency (a
ring: every rank sends and receives 2(d-1) chunks of B/d), bandwidth(B) interpolated from
the link's measured `allreduce_bandwidth` points (`cluster.Link`): gloo reduces in memory,
faster while a buffer fits in the caches than once it streams from DRAM.
`--calibrate N` measures 2 ranks N times, keeps each size's median and writes the latency
(least squares on relative error) and the per-size bandwidths into
`configs/hardware/cpu.json`'s node section; run it on an otherwise idle machine. 4 ranks
share 2 cores, so their times measure CPU contention as much as the links, and are shown,
not held to the target. `markdown` reports each size's error.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import time
from pathlib import Path

from ftpipe_runtime.atomic import write_atomic

MB = 1_000_000
SIZES = tuple(n * MB for n in (1, 2, 4, 8, 16, 32, 64, 100))
ROUNDS = 12
RANKS = (2, 4)
CORES = os.cpu_count() or 1  # the target holds for ranks that each have a core


def time_allreduce(sizes: list[int], rounds: int = ROUNDS) -> list[float]:
    """Fastest seconds of one blocking all-reduce of each size on every rank (rank 0's clock),
    over `rounds` rounds of one all-reduce per size."""
    import torch
    import torch.distributed as dist

    bufs = [torch.ones(n // 4, dtype=torch.float32) for n in sizes]
    for buf in bufs:  # warm-up: connections, buffers, pages
        dist.all_reduce(buf)
    best = [float("inf")] * len(sizes)
    for _ in range(rounds):
        for i, buf in enumerate(bufs):
            dist.barrier()
            start = time.perf_counter()
            dist.all_reduce(buf)
            best[i] = min(best[i], time.perf_counter() - start)
    return best


def worker(argv=None) -> None:
    import torch.distributed as dist

    ap = argparse.ArgumentParser(description="gloo all-reduce times per message size")
    ap.add_argument("--result", required=True)
    ap.add_argument("--sizes", default=",".join(map(str, SIZES)))
    ap.add_argument("--rounds", type=int, default=ROUNDS)
    args = ap.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",")]
    dist.init_process_group("gloo")
    times = time_allreduce(sizes, args.rounds)
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


def run_ranks(work: Path, d: int, sizes, tag: str = "") -> list[float]:
    """Seconds per size of a 2- or 4-rank torchrun of the worker."""
    from benchmarks.harness.launch import torchrun

    result = work / f"allreduce-{d}{tag}.json"
    args = [
        "-m",
        "benchmarks.allreduce.bench",
        "--result",
        result,
        "--sizes",
        ",".join(map(str, sizes)),
    ]
    torchrun(args, work / f"allreduce-{d}{tag}.log", nproc=d)
    return json.loads(result.read_text())["seconds"]


def measure(work: Path | None = None, ranks=RANKS, sizes=SIZES) -> dict:
    import tempfile

    from ftpipe_compiler.costs.cluster import get_cluster

    work = Path(work or tempfile.mkdtemp(prefix="ftpipe-allreduce-"))
    work.mkdir(parents=True, exist_ok=True)
    measured = {d: run_ranks(work, d, sizes) for d in ranks}
    link = get_cluster("cpu", gpus=max(ranks)).intra_node
    rows = []
    for d in ranks:
        for nbytes, t in zip(sizes, measured[d]):
            sim = link.allreduce_s(nbytes, d)
            rows.append({"ranks": d, "bytes": nbytes, "measured_s": t, "simulated_s": sim,
                         "error": sim / t - 1})  # fmt: skip
    bw, lat = fit([(r["ranks"], r["bytes"], r["measured_s"]) for r in rows])
    return {
        "link": link.to_json(),
        "refit": {"bandwidth": bw, "latency_s": lat},
        "rows": rows,
        "max_abs_error": max(abs(r["error"]) for r in rows if r["ranks"] <= CORES),
    }


def calibrate(runs: int, hardware: Path, sizes=SIZES) -> dict:
    """Measure 2 ranks `runs` times and store the median of each size in `hardware`'s
    intra-node link: a latency and the bandwidth each size reaches after it."""
    import statistics
    import tempfile

    spec = json.loads(hardware.read_text())  # before measuring: a bad path fails at once
    work = Path(tempfile.mkdtemp(prefix="ftpipe-allreduce-calibrate-"))
    per_run = [run_ranks(work, 2, sizes, f"-{i}") for i in range(runs)]
    median = [statistics.median(ts) for ts in zip(*per_run)]
    _, latency = fit([(2, n, t) for n, t in zip(sizes, median)])
    curve = [[n, round(ring_factor(2) * n / (t - 2 * latency), -6)] for n, t in zip(sizes, median)]
    intra = spec["node"]["intra_node"]
    intra["latency_s"] = round(latency, 7)
    intra["allreduce_bandwidth"] = curve
    text = re.sub(r"\[\s+(\S+),\s+(\S+)\s+\]", r"[\1, \2]", json.dumps(spec, indent=2))
    write_atomic(hardware, text + "\n")  # one [bytes, bandwidth] pair per line
    return {"runs": per_run, "median": median, "latency_s": latency, "curve": curve}


def markdown(data: dict) -> str:
    link = data["link"]
    curve = link.get("allreduce_bandwidth") or [[0, link["bandwidth"]]]
    lines = [
        "## Data-parallel all-reduce: gloo on this machine vs the simulator",
        "",
        "`dist.all_reduce` of float32 tensors among 2 and 4 local CPU ranks (one thread each), "
        "fastest of 12 interleaved rounds, against the simulator's ring model 2(d-1)/d x bytes / "
        "bandwidth(bytes) + 2(d-1) x latency with `configs/hardware/cpu.json`'s figures "
        f"({link['latency_s'] * 1e6:.0f} us; bandwidth "
        + ", ".join(f"{w / 1e9:.2f} GB/s at {b / MB:.0f} MB" for b, w in curve)
        + ": the median of several 2-rank runs on this 2-core machine, stored by "
        "`python -m benchmarks.allreduce.bench --calibrate`; 4 ranks oversubscribe the cores).",
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
    if "RANK" in os.environ:
        worker()
    else:
        ap = argparse.ArgumentParser(description="store this machine's gloo all-reduce figures")
        ap.add_argument("--calibrate", type=int, metavar="RUNS", required=True)
        ap.add_argument(
            "--hardware",
            type=Path,
            default=Path(__file__).resolve().parents[2] / "configs/hardware/cpu.json",
        )
        args = ap.parse_args()
        out = calibrate(args.calibrate, args.hardware)
        print(json.dumps({k: out[k] for k in ("median", "latency_s", "curve")}, indent=1))
