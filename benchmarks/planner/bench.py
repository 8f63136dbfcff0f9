"""Section `planner`: the shape (replicas x depth) ftpipe chooses for a cluster, and how long
choosing takes.

    python -m benchmarks --sections planner --out /tmp/planner.md

Targets (issue 16): the planner's choice for T5-11B on 64 x v100-32gb (8 per node) reaches
an effective speedup >= 0.9 x 64 in simulation, and T5-3B on 16 x rtx2080ti >= 0.9 x 16,
each planned in under 5 minutes on this machine. Effective speedup = the plan's simulated
samples/s over those of one GPU running the same work (forward, backward, recompute) back to
back (`planner.effective_speedup`). Every case plans a global batch of 40 sequences per GPU
(micro-batches of 4, the task's), so every shape trains the same batch; the second table
grows the cluster from 8 to 512 GPUs and times the planning.
"""

from __future__ import annotations

import functools
import time
from functools import partial

from ftpipe_compiler.costs.cluster import get_cluster
from ftpipe_compiler.costs.profilers import costed_graph
from ftpipe_compiler.planner import Space, orientation_of, plan_shape

TARGETS = [("t5-11b", "rte", "v100-32gb", 64), ("t5-3b", "rte", "rtx2080ti", 16)]
SCALING = ("t5-3b", "rte", "rtx2080ti", (64, 512))  # 16: the target
SCHEDULES = ("ftpipe",)
PER_GPU = 40  # sequences per step and GPU


def _graphs(model: str, task: str, hardware: str):
    @functools.lru_cache(None)
    def graph_for(b):
        return costed_graph(model, task, hardware, b)[3]

    return graph_for


def plan_case(model: str, task: str, hardware: str, gpus: int, graph_for=None) -> dict:
    graph_for = graph_for or _graphs(model, task, hardware)
    cluster = get_cluster(hardware, gpus)
    space = Space(
        batch=PER_GPU * gpus, schedules=SCHEDULES, recompute=(True, False), optimizer="adafactor"
    )
    t0 = time.perf_counter()
    found = plan_shape(graph_for, cluster, space, progress=False)
    seconds = time.perf_counter() - t0
    j = found.to_json()
    status = {}
    for c in j["candidates"]:
        status[c["status"]] = status.get(c["status"], 0) + 1
    return {
        "model": model,
        "task": task,
        "hardware": hardware,
        "gpus": gpus,
        "gpus_per_node": cluster.gpus_per_node,
        "orientation": orientation_of(found.plan.placed()),
        "seconds": seconds,
        "statuses": status,
        **{k: v for k, v in j.items() if k not in ("candidates", "placement")},
        "candidates": j["candidates"],
    }


def scaling() -> list[dict]:
    model, task, hardware, sizes = SCALING
    graph_for = _graphs(model, task, hardware)
    graph_for(None)  # traced once, outside the timings
    return [plan_case(model, task, hardware, n, graph_for) for n in sizes]


# Each target and the scaling apart: they only compute, two at a time (benchmarks.sections).
PARTS = {case[0]: (partial(plan_case, *case), False) for case in TARGETS}
PARTS["scaling"] = (scaling, False)


def combine(parts: dict) -> dict:
    return {"targets": [parts[case[0]] for case in TARGETS], "scaling": parts["scaling"]}


def measure() -> dict:
    return combine({name: run() for name, (run, _) in PARTS.items()})


def markdown(data: dict) -> str:
    lines = [
        "## Data x pipeline parallelism: the planner's shape",
        "",
        "`plan_shape` (what `ftpipe compile --gpus N --gpus-per-node 8` runs): replicas d x "
        "pipeline depth p = N, recompute or keeping activations, each candidate partitioned "
        "by every partitioner, replicated, placed in each orientation the nodes allow and "
        "simulated with its gradient all-reduce; candidates taken best bound first and "
        "pruned within a 5% gap. Global batch 40 sequences per GPU (micro-batches of 4), "
        "the FTPipe schedule, the nodes and networks of `configs/hardware/*.json`.",
        "",
        "| model | GPUs | d x p | m x b per replica | schedule | orientation | partitioner | "
        "samples/s | effective speedup | target | planning s |",
        "|---|---:|---|---|---|---|---|---:|---:|---:|---:|",
    ]
    for r in data["targets"]:
        rec = "" if r["recompute"] else ", keep activations"
        lines.append(
            f"| {r['model']} on {r['hardware']} | {r['gpus']} | {r['replicas']} x "
            f"{r['gpus_per_replica']} | {r['micro_batches']} x {r['micro_batch']} | "
            f"{r['schedule']}{rec} | {r['orientation']} | {r['partitioner']} | "
            f"{r['samples_per_s']:.2f} | {r['effective_speedup']:.1f} | "
            f">= {0.9 * r['gpus']:.1f} | {r['seconds']:.0f} |"
        )
    lines += ["", "Every candidate of the targets:", ""]
    lines += [
        "| model | d x p | recompute | status | bound samples/s | simulated samples/s | "
        "effective speedup | seconds |",
        "|---|---|---|---|---:|---:|---:|---:|",
    ]
    for r in data["targets"]:
        for c in r["candidates"]:
            lines.append(
                f"| {r['model']} | {c['replicas']} x {c['gpus']} | {c['recompute']} | "
                f"{c['status']} | {c['bound']:.2f} | {c['samples_per_s']:.2f} | "
                f"{c['effective_speedup']:.1f} | {c['seconds']:.1f} |"
            )
    model, task, hardware, _ = SCALING
    lines += [
        "",
        f"Planning time as the cluster grows ({model}, {task}, {hardware}, nodes of 8; the "
        "graph traced once beforehand; 16 GPUs: the target above, tracing included):",
        "",
        "| GPUs | shapes | simulated | pruned | chosen d x p | effective speedup | "
        "/ GPUs | planning s |",
        "|---:|---:|---:|---:|---|---:|---:|---:|",
    ]
    for r in data["scaling"]:
        st = r["statuses"]
        lines.append(
            f"| {r['gpus']} | {sum(st.values())} | {st.get('simulated', 0) + st.get('chosen', 0)} "
            f"| {st.get('pruned', 0)} | {r['replicas']} x {r['gpus_per_replica']} | "
            f"{r['effective_speedup']:.1f} | {r['effective_speedup'] / r['gpus']:.2f} | "
            f"{r['seconds']:.1f} |"
        )
    lines.append("")
    return "\n".join(lines)
