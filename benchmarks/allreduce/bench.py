"""Section `allreduce`: gloo all-reduce on this machine against the simulator's ring model.

    python -m benchmarks --sections allreduce --out /tmp/allreduce.md
    python -m benchmarks.calibrate --write cpu   # measure this machine, store in cpu.json

2 and 4 local CPU ranks (one thread each) sum float32 tensors of 1 to 100 MB with
`dist.all_reduce`, as the runtime's gradient buckets do. The sizes are timed in rounds, one
all-reduce of each size per round, and each size's fastest round kept: other processes
share this machine's cores, the fastest is the least disturbed, and interleaving spreads a
disturbance over all sizes instead of one. The simulator charges a data-parallel
all-reduce of B bytes over d replicas 2(d-1)/d * B / bandwidth(B) + 2(d-1) * latency (a
ring: every rank sends and receives 2(d-1) chunks of B/d), bandwidth(B) interpolated from
the link's measured `allreduce_bandwidth` points (`cluster.Link`): gloo reduces in memory,
faster while a buffer fits in the caches than once it streams from DRAM.
`benchmarks.calibrate` measures 2 ranks several times, keeps each size's median and writes the
latency (`calibrate.fit`) and the per-size bandwidths into `configs/hardware/cpu.json`'s node
section; run it on an otherwise idle machine. 4 ranks
share 2 cores, so their times measure CPU contention as much as the links, and are shown,
not held to the target. `markdown` reports each size's error.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from benchmarks.allreduce.worker import ROUNDS, SIZES  # 1 to 100 MB
from benchmarks.calibrate import fit
from benchmarks.harness.launch import torchrun

ALONE = True  # it times processes: the machine to itself (benchmarks.sections)

MB = 1_000_000
RANKS = (2, 4)
CORES = os.cpu_count() or 1  # the target holds for ranks that each have a core


def ring_factor(ranks: int) -> float:
    return 2 * (ranks - 1) / ranks


def run_ranks(work: Path, d: int, sizes, tag: str = "") -> list[float]:
    """Seconds per size of a run of the worker on 2 or 4 ranks (`torchrun`)."""
    result = work / f"allreduce-{d}{tag}.json"
    args = ["-m", "benchmarks.allreduce.worker", "--result", result, "--sizes"]
    args.append(",".join(map(str, sizes)))
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
    lat, bw = fit(
        [(2 * (r["ranks"] - 1), ring_factor(r["ranks"]) * r["bytes"]) for r in rows],
        [r["measured_s"] for r in rows],
    )
    return {
        "link": link.to_json(),
        "refit": {"bandwidth": bw, "latency_s": lat},
        "rows": rows,
        "max_abs_error": max(abs(r["error"]) for r in rows if r["ranks"] <= CORES),
    }


def markdown(data: dict) -> str:
    link = data["link"]
    curve = link.get("allreduce_bandwidth") or [[0, link["bandwidth"]]]
    lines = [
        "## Data-parallel all-reduce: gloo on this machine vs the simulator",
        "",
        "`dist.all_reduce` of float32 tensors among 2 and 4 local CPU ranks (one thread each), "
        f"fastest of {ROUNDS} interleaved rounds, against the simulator's ring model 2(d-1)/d x bytes / "
        "bandwidth(bytes) + 2(d-1) x latency with `configs/hardware/cpu.json`'s figures "
        f"({link['latency_s'] * 1e6:.0f} us; bandwidth "
        + ", ".join(f"{w / 1e9:.2f} GB/s at {b / MB:.0f} MB" for b, w in curve)
        + ": the median of several 2-rank runs on this 2-core machine, stored by "
        "`python -m benchmarks.calibrate`; 4 ranks oversubscribe the cores).",
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
