"""`ftpipe compile` on a cluster: the planner chooses replicas x pipeline depth.

    ftpipe compile -m t5-11b -t rte --batch 640 --gpus 64 --hardware v100-32gb --gpus-per-node 8
    ftpipe compile -m t5-3b --gpus 16 --cluster lab.json --replicas 2   # the width fixed

`compile` comes here when a cluster is described (`--gpus-per-node`, `--cluster`) or the
width is given (`--replicas`); otherwise it plans one pipeline as before. The search is
`planner.plan_shape`'s; this module turns the options into its `Space` and its result into
the lines `compile` prints.
"""

from __future__ import annotations

import math

import click

from ..costs.cluster import Cluster, get_cluster, load_cluster
from ..costs.profilers import costed_graph
from ..planner import Space, orientation_of, plan_shape
from ..planner.search import Found, per_replica
from ..planner.shapes import depths
from ..units import rate

__all__ = ["batch_note", "cluster_of", "describe_shapes", "plan_on_cluster"]


def cluster_of(hardware: str, gpus: int, gpus_per_node, cluster_file, replicas=None) -> Cluster:
    """The cluster the options describe: a `--cluster` file, or the hardware's nodes."""
    if cluster_file and gpus_per_node:
        raise click.UsageError("give --cluster or --gpus-per-node, not both")
    if replicas and gpus % replicas:
        raise click.UsageError(
            f"--replicas {replicas} does not divide --gpus {gpus}: every replica is a "
            "pipeline of --gpus / --replicas GPUs"
        )
    if cluster_file:
        return load_cluster(cluster_file, gpus)
    return get_cluster(hardware, gpus, gpus_per_node)


def plan_on_cluster(first, cluster: Cluster, cost_args: dict, options: dict) -> tuple[Found, dict]:
    """Search the shapes; `first` is the (spec, task, traced, graph) already traced with the
    task's micro-batch, `cost_args` what traced it. Returns the search and every trace
    made, by micro-batch size (the package is generated from the winner's)."""
    t = first[1]
    traces = {t.micro_batch: first}

    def graph_for(b):
        b = b or t.micro_batch
        if b not in traces:
            traces[b] = costed_graph(**{**cost_args, "micro_batch": b})
        return traces[b][3]

    space = Space(
        batch=t.batch,
        micro_batch_sizes=(t.micro_batch,),
        schedules=tuple(options["schedule"]),
        recompute=(True, False),
        replicas=options["replicas"],
        micro_batches=options["micro_batches"],
        partitioners=options["partitioners"],
        optimizer=options["optimizer"],
        seed=options["seed"],
        steps=options["steps"],
        width=options.get("width", 1),
        workers=options.get("workers"),
        shard=options.get("shard", "none"),
    )
    found = plan_shape(graph_for, cluster, space, progress=False)  # the driver's bar is enough
    return found, traces


def describe_shapes(found: Found, cluster: Cluster, note: str | None = None) -> list[str]:
    """The candidates table (and `note` below it) and where the chosen plan puts its ranks."""
    lines = [
        f"{cluster.describe()}: {len(found.rows)} shapes, planned in {found.seconds:.1f} s",
        f"  {'replicas x GPUs':<16} {'m x b':>9} {'schedule':<16} {'status':<11} "
        f"{'bound':>9} {'samples/s':>10} {'speedup':>8}",
    ]
    for r in found.rows:
        c = r.candidate
        sched = c.schedule + ("" if c.recompute else " keep")
        lines.append(
            f"  {f'{c.replicas} x {c.gpus}':<16} {f'{c.micro_batches} x {c.micro_batch}':>9} "
            f"{sched:<16} {r.status:<11} {rate(r.bound):>9} {rate(r.samples_per_s):>10} "
            f"{r.effective_speedup:8.1f}"
        )
    if note:
        lines.append(note)
    plan = found.plan
    placed = plan.placed()
    lines.append(
        f"chosen: {plan.replicas} replicas x {plan.gpus} GPUs ({orientation_of(placed)} "
        f"orientation), {len(plan.stages)} stages; where the ranks go:"
    )
    per_node: dict[int, list[str]] = {}
    for rank, (replica, gpu) in enumerate(placed):
        stages = ",".join(str(s.id) for s in plan.stages_on(gpu))
        per_node.setdefault(cluster.node_of(rank), []).append(
            f"rank {rank} = replica {replica} GPU {gpu} (stages {stages})"
        )
    for node, ranks in sorted(per_node.items()):
        lines.append(f"  node {node}: " + "; ".join(ranks))
    return lines


def batch_note(cluster: Cluster, batch: int, micro_batch: int, chosen: int) -> str | None:
    """A line for a batch that held the planner back: it chose `chosen` replicas, the most
    the batch splits into whole micro-batches, and wider shapes were not tried (a 64-GPU
    cluster at the task's 40 sequences a step tries 1 and 2 replicas only); with the least
    batch that splits for every width.

    >>> batch_note(get_cluster("v100-32gb", 64, 8), 40, 4, chosen=2)  # doctest: +ELLIPSIS
    'note: a batch of 40 sequences ... --batch 256 ...'
    """
    widths = [cluster.gpus // p for p in depths(cluster)]
    left = [d for d in widths if per_replica(batch, d, micro_batch) is None]
    tried = [d for d in widths if d not in left]
    if not left or chosen < max(tried, default=0) or max(left) < chosen:
        return None
    need = math.lcm(*(d * micro_batch for d in widths))
    return (
        f"note: a batch of {batch} sequences makes whole micro-batches of {micro_batch} for "
        f"{_counts(tried) or 'no'} replicas, so {_counts(left)} replicas were not tried; "
        f"--batch {-(-batch // need) * need} lets the planner weigh every shape (it also "
        "changes what a step trains on)"
    )


def _counts(values: list[int]) -> str:
    words = [str(v) for v in sorted(values)]
    return " and ".join(words) if len(words) < 3 else ", ".join(words[:-1]) + " and " + words[-1]
