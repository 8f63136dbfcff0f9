"""`ftpipe compile`'s phases and what it prints; `compile.py` turns the options into a `Job`
and `driver.drive` runs one of the two pipelines:

    one pipeline:  trace and profile -> partition x schedule, simulated -> [freeze-training
                   plans] -> generate
    on a cluster:  trace and profile -> plan replicas x depth -> [freeze-training plans]
                   -> generate

Each phase reads what the earlier ones left on the job and adds its own; none of them times,
prints or draws progress.
"""

from __future__ import annotations

import json
import shlex
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import click
from ftpipe_runtime.atomic import write_atomic
from ftpipe_runtime.train.replicas import launch_hint

from ..codegen import generate_package
from ..costs.cluster import Cluster
from ..costs.formulas import describe
from ..costs.profilers import costed_graph
from ..model.frozen import describe_frozen
from ..output import output_folder
from ..partition import problem_from_graph
from ..planner.matrix import search_matrix
from ..planner.shrink import index_of, shrink_plans
from ..simulate import write_report
from .cluster import describe_shapes, plan_on_cluster
from .driver import Phase, Pipeline
from .tables import matrix_table

__all__ = ["Job", "pipeline_for"]


@dataclass
class Job:
    """What the phases share: the options first, then what each phase adds."""

    out: Path
    force: bool
    command: str
    cost_args: dict  # costed_graph's keywords (model, task, hardware, shapes, profiler ...)
    gpus: int
    schedules: list[str]
    search_width: int
    partitioners: list[str] | None
    optimizer: str | None
    micro_batches: int | None
    replicas: int | None
    steps: int
    seed: int
    freeze_alpha: float | None
    cluster: Cluster | None  # given: the planner chooses replicas x depth on it
    progress: bool
    # --- added by the phases ---
    spec: object = None
    task: object = None
    traced: object = None
    graph: object = None
    problem: object = None  # one pipeline: what the matrix searched
    best: object = None  # one pipeline: the winning cell
    matrix: list = field(default_factory=list)
    found: object = None  # on a cluster: the planner's search
    plan: object = None
    sim: object = None
    shrinks: tuple = ()
    package: Path | None = None


def pipeline_for(job: Job) -> Pipeline:
    search = (
        Phase("plan replicas x depth", "plan_s", plan_cluster, weight=2)
        if job.cluster
        else Phase("partition x schedule, simulated", "search_s", search_schedules, weight=2)
    )
    shrink = (Phase("freeze-training plans", "freeze_training_s", freeze_training, weight=0),)
    phases = (
        Phase("trace and profile", "trace_profile_s", trace),
        search,
        *(shrink if job.freeze_alpha is not None else ()),
        Phase("generate", "generate_s", generate),
    )
    if job.cluster:
        return Pipeline(phases, cluster_json, cluster_lines)
    return Pipeline(phases, one_json, one_lines)


# --- phases ---
def trace(job: Job) -> None:
    job.spec, job.task, job.traced, job.graph = costed_graph(**job.cost_args)
    t = job.task
    if job.micro_batches and job.cost_args.get("batch") and not job.cluster:
        if job.micro_batches * t.micro_batch != t.batch:
            raise click.UsageError(
                f"--batch {t.batch} is not --micro-batches {job.micro_batches} x micro-batch "
                f"{t.micro_batch}; give one of the two"
            )


def search_schedules(job: Job) -> None:
    """Every partitioner under every schedule asked for, simulated (planner/matrix.py)."""
    t = job.task
    job.problem = problem_from_graph(
        job.graph,
        job.gpus,
        job.cost_args["hardware"],
        "1f1b",  # any free-placement schedule: search_matrix sets each cell's own
        job.optimizer or t.optimizer,
        job.micro_batches or t.micro_batches,
        job.seed,
    )
    job.best, job.matrix = search_matrix(job.problem, job.schedules, job.partitioners,
                                         steps=job.steps, width=job.search_width)  # fmt: skip
    job.sim = job.best.sim
    rows = tuple(c.to_json() for c in job.matrix)
    job.plan = job.best.plan.with_(competitors=rows, simulated=job.sim.summary(),
                                   command=job.command)  # fmt: skip


def plan_cluster(job: Job) -> None:
    """Replicas x depth, micro-batch, schedule and recompute on the cluster (planner/)."""
    t = job.task
    options = dict(schedule=job.schedules, replicas=job.replicas, micro_batches=job.micro_batches,
                   partitioners=job.partitioners, optimizer=job.optimizer or t.optimizer,
                   seed=job.seed, steps=job.steps, progress=job.progress)  # fmt: skip
    first = (job.spec, t, job.traced, job.graph)
    job.found, traces = plan_on_cluster(first, job.cluster, job.cost_args, options)
    _, _, job.traced, job.graph = traces[job.found.candidate.micro_batch]
    job.sim = job.found.sim
    job.plan = job.found.plan.with_(competitors=job.found.competitors,
                                    simulated=job.sim.summary(), command=job.command)  # fmt: skip


def freeze_training(job: Job) -> None:
    """--freeze-training: the shorter pipelines' plans (planner/shrink.py)."""
    job.shrinks = shrink_plans(job.graph, job.plan, alpha=job.freeze_alpha,
                               hardware=job.cost_args["hardware"] or job.graph.hardware,
                               partitioners=job.partitioners, steps=job.steps,
                               seed=job.seed)  # fmt: skip


def generate(job: Job) -> None:
    """Write plan.json, report.html and the package into `out`, all or nothing; each
    shrink's package goes in the package's elastic/<name>/."""
    with output_folder(job.out, job.force) as tmp:
        job.plan.save(tmp / "plan.json")
        write_report(tmp / "report.html", job.plan, job.sim, job.command)
        pkg = generate_package(job.traced, job.graph, job.plan, job.spec, tmp, job.command,
                               force=True)  # fmt: skip
        for s in job.shrinks:
            sub = generate_package(job.traced, job.graph, s.plan, job.spec,
                                   tmp / "_elastic" / s.name, job.command, force=True)  # fmt: skip
            (pkg / "elastic").mkdir(exist_ok=True)
            # As deep as where it was written: its paths relative to itself (the model's
            # folder) stay right.
            sub.rename(pkg / "elastic" / s.name)
        if job.shrinks:
            shutil.rmtree(tmp / "_elastic")  # emptied: each shrink moved into the package
            index = json.dumps(index_of(job.shrinks), indent=1)
            write_atomic(pkg / "elastic" / "index.json", index)
    job.package = job.out / pkg.name


# --- what it prints ---
def one_json(job: Job, timings: dict) -> dict:
    return {
        "lower_bound_s": job.best.bound_s / job.problem.micro_batches,
        "winner": job.best.partitioner,
        "precision": job.problem.precision.name,
        "frozen": [p.name for p in job.graph.params if p.frozen],
        "schedule": job.best.schedule,
        "gpus": job.plan.gpus,
        "results": list(job.plan.competitors),
        "package": str(job.package),
        "output": str(job.out),
        "simulated": job.sim.summary(),
        "timings": timings,
    }


def one_lines(job: Job, timings: dict) -> list[str]:
    graph, problem, plan, best, sim = job.graph, job.problem, job.plan, job.best, job.sim
    lines = [
        f"{job.spec.name}: {len(graph.nodes):,} nodes, {graph.num_parameters:,} parameters, "
        f"{job.gpus} x {problem.hardware.name}, {problem.optimizer}, "
        f"{problem.micro_batches} micro-batches of {graph.meta.get('micro_batch')}",
        describe(problem.precision, problem.hardware),
        *([describe_frozen(graph)] if describe_frozen(graph) else []),
        matrix_table(list(plan.competitors)),
        f"winner: {best.partitioner} under {best.schedule} ({len(plan.stages)} stages, "
        f"{sim.samples_per_s:.2f} samples/s simulated, bubble {sim.bubble_fraction:.1%})",
        _wrote(job, timings),
    ]
    if plan.gpus < job.gpus:
        lines.append(
            f"note: the best plan uses {plan.gpus} of the {job.gpus} GPUs asked for; the others "
            "would have no stage to run"
        )
    lines += _shrink_lines(job)
    pkg = job.package.name
    lines.append(f"run it: cd {_quoted(job.out)} && torchrun --nproc_per_node {plan.gpus} -m {pkg}")
    return lines


def cluster_json(job: Job, timings: dict) -> dict:
    plan = job.plan
    return {
        "replicas": plan.replicas,
        "gpus_per_replica": plan.gpus,
        "winner": plan.partitioner,
        "gpus": plan.world,
        "planner": job.found.to_json(),
        "package": str(job.package),
        "output": str(job.out),
        "simulated": job.sim.summary(),
        "timings": timings,
    }


def cluster_lines(job: Job, timings: dict) -> list[str]:
    hint = launch_hint(job.plan.to_json())
    return [
        *describe_shapes(job.found, job.cluster),
        _wrote(job, timings),
        *_shrink_lines(job),
        f"run it on every node: cd {_quoted(job.out)} && torchrun {hint} -m {job.package.name}",
    ]


def _wrote(job: Job, timings: dict) -> str:
    return (
        f"wrote {job.out}/plan.json, {job.out}/report.html and the package {job.package} "
        f"in {timings['total_s']:.1f} s"
    )


def _quoted(path: Path) -> str:
    """A folder as the shell reads it back, whatever its name holds (spaces, quotes, newlines)."""
    return shlex.quote(str(path))


def _shrink_lines(job: Job) -> list[str]:
    return [
        f"freeze training: from {s.frozen} frozen layers on {s.plan.replicas} replicas x "
        f"{s.plan.gpus} GPUs ({job.package}/elastic/{s.name})"
        for s in job.shrinks
    ]
