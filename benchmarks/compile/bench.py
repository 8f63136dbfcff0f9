"""Section `compile`: the phases of `ftpipe compile --model t5-3b --gpus 8`, timed by the command,
and of the cluster planner's `ftpipe compile --model t5-11b --gpus 64 --gpus-per-node 8
--hardware v100-32gb` (issue 35: under a minute at the effective speedup it reaches), as
given and at the planner section's batch.

python -m benchmarks --sections compile --out /tmp/compile.md

The hardware is named (the default one where no GPU is found), so that a machine with a GPU
measures the same compile; the searches use every core.
"""

from __future__ import annotations

import json
import os
import platform
from pathlib import Path

import torch
from ftpipe_runtime.atomic import write_atomic

from benchmarks.compile import sent_bytes
from ftpipe_compiler.cli.hardware import DEFAULT
from ftpipe_compiler.plan import Plan
from ftpipe_compiler.planner.matrix import cores

ALONE = True  # it times processes: the machine to itself (benchmarks.sections)


CLUSTER = ("t5-11b", 64, 8, "v100-32gb")  # model, GPUs, GPUs per node, hardware
# The same command at the planner section's 40 sequences per GPU and step (its 62.0): the
# task's own batch of 40 sequences a step leaves a 64-GPU cluster a few micro-batches each.
CLUSTER_BATCH = 40 * 64
# Compiles of a timed target, each in a fresh process; the median run is reported. One plain
# Python loop's time varies by +-30% from run to run on this shared VM, so one compile can
# neither meet nor miss a target of 12 or 60 s by itself. T5-3B's compile runs 5 times: two
# medians of 3 of the same code, an hour apart, read 10.8 and 12.5 s. The cluster's ran 3
# times at 38-44 s against its 60 s: once now, for make bench's ~20 minutes.
REPEATS = 1
T5_REPEATS = 5


def _median_compile(argv: list[str], out: Path, repeats: int) -> dict:
    """`_compile` `repeats` times into `out` (the last run's files kept): the run of median
    total, with every run's total and start-to-exit seconds (`runs`)."""
    import shutil

    got = []
    for _ in range(repeats):
        shutil.rmtree(out, ignore_errors=True)
        got.append(_compile(argv, out))
    ranked = sorted(got, key=lambda d: d["timings"]["total_s"])
    median = ranked[len(ranked) // 2]
    median["runs"] = [(d["timings"]["total_s"], d["timings"]["wall_s"]) for d in got]
    return median


def _compile(argv: list[str], out: Path) -> dict:
    """`ftpipe compile` in a process of its own, as a user runs it (imports of torch and
    transformers included: in this process they would be warm from other sections): its
    --json output, with `wall_s`, the seconds from the process's start to its exit."""
    import subprocess
    import sys
    import time

    cmd = [sys.executable, "-m", "ftpipe_compiler", "compile", *argv, "-o", str(out), "--json"]
    t0 = time.perf_counter()
    r = subprocess.run(cmd, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if r.returncode != 0:
        raise RuntimeError(r.stdout + r.stderr)
    data = json.loads(r.stdout[r.stdout.index("{") :])
    data["timings"]["wall_s"] = wall
    return data


def measure(model="t5-3b", gpus=8, hardware=DEFAULT) -> dict:
    """The phases of `ftpipe compile`, timed by the command itself."""
    import tempfile

    load = os.getloadavg()[0]  # other processes' work as it starts (the machine is shared)
    with tempfile.TemporaryDirectory() as tmp:
        argv = ["--model", model, "--gpus", str(gpus), "--hardware", hardware]
        data = _median_compile(argv, Path(tmp) / "out", T5_REPEATS)
        figures = save_figures(Path(tmp) / "out" / "report.html", FIGURES)
        sent = sent_bytes.bytes_three_ways(Plan.load(Path(tmp) / "out" / "plan.json"), model)
        cluster = measure_cluster(Path(tmp) / "cluster")
        cluster_batch = measure_cluster(Path(tmp) / "cluster-batch", batch=CLUSTER_BATCH,
                                        repeats=REPEATS)  # fmt: skip
    return {
        "model": model,
        "gpus": gpus,
        "hardware": hardware,
        "cores": cores(),
        "load_before": load,
        "timings": data["timings"],
        "runs": data["runs"],
        "winner": data["winner"],
        "schedule": data["schedule"],
        "figures": figures,
        "bytes": sent,
        "cluster": cluster,
        "cluster_batch": cluster_batch,
    }


def measure_cluster(out: Path, case=CLUSTER, batch: int | None = None, repeats: int = 1) -> dict:
    """The cluster planner's compile (`CLUSTER`, at `batch` sequences a step where given),
    timed by the command (the median of `repeats` runs), and what it chose."""
    model, gpus, per_node, hardware = case
    load = os.getloadavg()[0]
    argv = ["--model", model, "--gpus", str(gpus), "--gpus-per-node", str(per_node),
            "--hardware", hardware, *(["--batch", str(batch)] if batch else [])]  # fmt: skip
    data = _median_compile(argv, out, repeats)
    p = data["planner"]
    balance = _balance(Plan.load(out / "plan.json"))
    return {
        **balance,
        "command": "ftpipe compile " + " ".join(argv),
        "load_before": load,
        "timings": data["timings"],
        "runs": data["runs"],
        "shape": f"{p['replicas']} x {p['gpus_per_replica']}",
        "schedule": p["schedule"],
        "partitioner": p["partitioner"],
        "batch": p["batch"],
        "samples_per_s": p["samples_per_s"],
        "effective_speedup": p["effective_speedup"],
        "candidates": len(p["candidates"]),
    }


def _balance(plan: Plan) -> dict:
    """How evenly the chosen plan spreads its work: each GPU's compute seconds per micro-batch
    (its stages' forward, backward and recompute), the busiest against the mean, and the
    simulated time per micro-batch. With the same work spread evenly and the rest of each
    micro-batch's time (transfers, the step, the all-reduce) unchanged, the time per
    micro-batch would fall by busiest - mean: `balanced_speedup` is the effective speedup
    then, a ceiling for any cut of the same shape and micro-batch size."""
    per_gpu = plan.gpu_work_s()
    busiest, mean = max(per_gpu.values()), sum(per_gpu.values()) / len(per_gpu)
    sim = plan.simulated or {}
    per_micro_batch = float(sim.get("step_time_s", 0.0)) / plan.micro_batches
    return {"busiest_gpu_s": busiest, "mean_gpu_s": mean, "per_micro_batch_s": per_micro_batch}


FIGURES = Path(__file__).resolve().parents[2] / "docs"


def save_figures(report: Path, folder: Path) -> list[str]:
    """The report's timeline and memory charts as standalone SVG files, for the README."""
    import re

    html = report.read_text()
    folder.mkdir(exist_ok=True)
    saved = []
    for name in ("timeline", "memory"):
        m = re.search(rf'<svg xmlns="http://www.w3.org/2000/svg" id="{name}".*?</svg>', html, re.S)
        if m:
            path = folder / f"t5-3b-{name}.svg"
            write_atomic(path, m.group(0) + "\n")
            saved.append(str(path.relative_to(folder.parent)))
    return saved


def markdown(data: dict) -> str:
    t = data["timings"]
    return "\n".join(
        [
            f"## 2. Compile time: `ftpipe compile --model {data['model']} --gpus {data['gpus']}`"
            + (
                f" (`--hardware {data['hardware']}`, the default without a GPU)"
                if "hardware" in data
                else ""
            ),
            "",
            "| trace + profile | partitioner x schedule, simulated (`--schedule auto`) | generate "
            "| total | command, start to exit |",
            "|---:|---:|---:|---:|---:|",
            f"| {t['trace_profile_s']:.1f} s | {t['search_s']:.1f} s | "
            f"{t['generate_s']:.1f} s | {t['total_s']:.1f} s | {_wall(t)} |",
            "",
            "*total* is the command's own count (the phases from the model's resolution on); "
            "the last column is what a user waits, Python and torch starting included. Each "
            "compile runs in a fresh process: the model's imports (transformers) are in "
            "*trace + profile*." + _runs(data),
            "",
            "Figures of the winning plan (from its report.html): "
            + ", ".join(f"[{Path(f).name}]({f})" for f in data.get("figures", []))
            + ".",
            "",
            sent_bytes.markdown(data["bytes"]) if "bytes" in data else "",
            "",
            *(_cluster_markdown(data["cluster"]) if "cluster" in data else []),
            *(_cluster_markdown(data["cluster_batch"]) if "cluster_batch" in data else []),
            f"Winner: {data['winner']} under {data['schedule']}. Measured on this machine ({platform.processor() or platform.machine()}, "
            f"{torch.get_num_threads()} threads"
            + (
                f"; the search in {data['cores']} processes, one per core; load average "
                f"{data['load_before']:.2f} when it started"
                if "cores" in data
                else ""
            )
            + ").",
            "",
        ]
    )


def _runs(data: dict) -> str:
    """The runs behind a median, in the order they ran."""
    runs = data.get("runs", [])
    if len(runs) < 2:
        return ""
    each = ", ".join(f"{total:.1f} s ({wall:.1f} s)" for total, wall in runs)
    return f" The median of {len(runs)} runs, each total (start to exit): {each}."


def _wall(timings: dict) -> str:
    return f"{timings['wall_s']:.1f} s" if "wall_s" in timings else "-"


def _cluster_markdown(c: dict) -> list[str]:
    t = c["timings"]
    return [
        f"The cluster planner: `{c['command']}` (`--schedule auto`, "
        + (
            f"{c['batch']:,} sequences per step as the planner section plans it"
            if "--batch" in c["command"]
            else f"the task's batch of {c['batch']} sequences per step"
        )
        + f"), {c['candidates']} candidates:",
        "",
        "| trace + profile | plan replicas x depth | generate | total | command, start to exit "
        "| chosen | effective speedup |",
        "|---:|---:|---:|---:|---:|---|---:|",
        f"| {t['trace_profile_s']:.1f} s | {t['plan_s']:.1f} s | {t['generate_s']:.1f} s | "
        f"{t['total_s']:.1f} s | {_wall(t)} | {c['shape']}, {c['schedule']}, {c['partitioner']}, "
        f"{c['samples_per_s']:.2f} samples/s | {c['effective_speedup']:.1f} |",
        "",
        *_balance_markdown(c),
        f"(load average {c['load_before']:.2f} when it started.{_runs(c)})",
        "",
    ]


def _balance_markdown(c: dict) -> list[str]:
    if not c.get("per_micro_batch_s"):
        return []
    busiest, mean, per = c["busiest_gpu_s"], c["mean_gpu_s"], c["per_micro_batch_s"]
    ceiling = c["effective_speedup"] * per / (per - (busiest - mean))
    return [
        f"What holds it back is balance: its busiest GPU computes {busiest * 1e3:.0f} ms per "
        f"micro-batch against {mean * 1e3:.0f} ms on average, and a micro-batch takes "
        f"{per * 1e3:.0f} ms. Spread evenly, the same work would give at most "
        f"{ceiling:.1f} effective speedup.",
        "",
    ]
