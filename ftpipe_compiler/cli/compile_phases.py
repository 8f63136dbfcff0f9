"""`ftpipe compile`'s phases and what it prints; `compile.py` turns the options into a `Job`
and `driver.drive` runs one of the two pipelines:

    one pipeline:  [measure the data] -> trace and profile -> partition x schedule, simulated
                   -> [freeze-training plans] -> generate
    on a cluster:  [measure the data] -> trace and profile -> plan replicas x depth
                   -> [freeze-training plans] -> generate

Each phase reads what the earlier ones left on the job and adds its own; none of them times
or prints: the driver does, and draws the progress a phase reports (`progress(done, total,
what)`).
"""

from __future__ import annotations

import json
import shlex
import shutil
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import click
from ftpipe_runtime.atomic import write_atomic
from ftpipe_runtime.train.replicas import launch_hint

from ..codegen import generate_package
from ..costs.cluster import Cluster
from ..costs.formulas import describe
from ..costs.profilers import costed_graph
from ..model.data_shapes import data_shapes
from ..model.frozen import describe_frozen
from ..model.tasks import resolve_task
from ..model.zoo import resolve_model
from ..output import COMPILED, output_folder
from ..partition import problem_from_graph
from ..planner.matrix import NothingFits, search_matrix, update_rule
from ..planner.nofit import check_floor, explain, floor_fits
from ..planner.offload import searches, shard_refusal
from ..planner.shrink import index_of, shrink_plans
from ..simulate import write_report
from ..simulate.network import shard_lines
from ..simulate.simulator import offload_report
from ..units import rate
from .cluster import batch_note, describe_shapes, plan_on_cluster
from .driver import Phase, Pipeline, Progress
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
    jobs: int | None  # processes for the search (None: one per core)
    partitioners: list[str] | None
    optimizer: str | None
    micro_batches: int | None
    replicas: int | None
    steps: int
    seed: int
    freeze_alpha: float | None
    cluster: Cluster | None  # given: the planner chooses replicas x depth on it
    offload: str = "auto"  # --offload (planner/offload.py's MODES)
    shard: str = "auto"  # --shard-optimizer (planner/offload.py's SHARD_MODES)
    offload_step: str = "exact"  # --offload-step (the plan's OFFLOAD_STEPS)
    inputs: dict = field(default_factory=dict)  # what it reads, kept out of `out` (output.py)
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
    data: object = None  # --data: DataRequest; measure_data sets the lengths from it
    shapes: object = None  # measure_data: the DataShapes chosen


def pipeline_for(job: Job) -> Pipeline:
    search = (
        Phase("plan replicas x depth", "plan_s", plan_cluster, weight=2)
        if job.cluster
        else Phase("partition x schedule, simulated", "search_s", search_schedules, weight=2)
    )
    shrink = (Phase("freeze-training plans", "freeze_training_s", freeze_training, weight=0),)
    phases = (
        *((Phase("measure the data", "data_s", measure_data),) if job.data else ()),
        Phase("trace and profile", "trace_profile_s", trace),
        search,
        *(shrink if job.freeze_alpha is not None else ()),
        Phase("generate", "generate_s", generate),
    )
    if job.cluster:
        return Pipeline(phases, cluster_json, cluster_lines)
    return Pipeline(phases, one_json, one_lines)


# --- phases ---
def measure_data(job: Job, progress: Progress) -> None:
    """--data: the sequence (and target) length from the data's token lengths, unless given."""
    args, d = job.cost_args, job.data
    spec = resolve_model(args["model"], args.get("head"))
    seq_len = args.get("seq_len")
    if d.text.pack and not seq_len:  # packed rows: the task's length unless given
        seq_len = resolve_task(spec, args.get("task"), None, None, None, None).seq_len
    job.shapes = data_shapes(spec, d.path, d.text, percentile=d.percentile,
                             seq_len=seq_len, target_len=args.get("target_len"))  # fmt: skip
    for key in ("seq_len", "target_len"):
        if getattr(job.shapes, key):
            args[key] = getattr(job.shapes, key)


def trace(job: Job, progress: Progress) -> None:
    measured = {"progress": progress} if job.cost_args.get("profile") == "measured" else {}
    job.spec, job.task, job.traced, job.graph = costed_graph(**job.cost_args, **measured)
    t = job.task
    if job.micro_batches and job.cost_args.get("batch") and not job.cluster:
        if job.micro_batches * t.micro_batch != t.batch:
            raise click.UsageError(
                f"--batch {t.batch} is not --micro-batches {job.micro_batches} x micro-batch "
                f"{t.micro_batch}; give one of the two"
            )


def _unlagged(job: Job) -> list[str]:
    """--offload-step lagged where no stage of the plan lags: one line saying why."""
    if job.offload_step != "lagged" or any(s.offload.lagged for s in job.plan.stages):
        return []
    why = (
        f"its schedule ({job.plan.schedule}) runs each step on the newest weights or on set-aside "
        "versions"
        if any(s.offload.optimizer for s in job.plan.stages)
        else "no stage offloads its optimizer"
    )
    return [f"note: --offload-step lagged changes nothing here: {why}"]


def search_schedules(job: Job, progress: Progress) -> None:
    """Every partitioner under every schedule asked for, simulated (planner/matrix.py); with
    --offload auto, again with every stage free to offload only when nothing fits without
    (planner/offload.py)."""
    t = job.task
    base = problem_from_graph(
        job.graph,
        job.gpus,
        job.cost_args["hardware"],
        "1f1b",  # any free-placement schedule: search_matrix sets each cell's own
        job.optimizer or t.optimizer,
        job.micro_batches or t.micro_batches,
        job.seed,
    )
    name = job.spec.name
    modes = searches(job.offload, base.hardware.host)
    for mode in modes:
        job.problem = replace(base, offload=mode, offload_step=job.offload_step)
        last = mode == modes[-1]
        if not floor_fits(job.problem):  # before minutes of search
            if last:
                check_floor(job.problem, name, job.schedules, job.steps)
            continue
        try:
            job.best, job.matrix = search_matrix(job.problem, job.schedules, job.partitioners,
                                                 steps=job.steps, width=job.search_width,
                                                 progress=progress, workers=job.jobs)  # fmt: skip
        except NothingFits as e:
            if last:
                raise explain(job.problem, name, job.schedules, e.matrix, job.steps) from None
            continue
        break
    job.sim = job.best.sim
    rows = tuple(c.to_json() for c in job.matrix)
    job.plan = job.best.plan.with_(competitors=rows, simulated=job.sim.summary(),
                                   command=job.command)  # fmt: skip


def plan_cluster(job: Job, progress: Progress) -> None:
    """Replicas x depth, micro-batch, schedule and recompute on the cluster (planner/)."""
    t = job.task
    optimizer = job.optimizer or t.optimizer
    refused = shard_refusal(optimizer, freezing=job.freeze_alpha is not None)
    if refused and job.shard == "always":
        raise click.UsageError(f"--shard-optimizer always: {refused}; leave it out")
    options = dict(schedule=job.schedules, replicas=job.replicas, micro_batches=job.micro_batches,
                   partitioners=job.partitioners, optimizer=optimizer,
                   seed=job.seed, steps=job.steps, width=job.search_width,
                   workers=job.jobs, shard="none" if refused else job.shard)  # fmt: skip
    first = (job.spec, t, job.traced, job.graph)
    job.found, traces = plan_on_cluster(first, job.cluster, job.cost_args, options)
    _, _, job.traced, job.graph = traces[job.found.candidate.micro_batch]
    job.sim = job.found.sim
    job.plan = job.found.plan.with_(competitors=job.found.competitors,
                                    simulated=job.sim.summary(), command=job.command)  # fmt: skip


def freeze_training(job: Job, progress: Progress) -> None:
    """--freeze-training: the shorter pipelines' plans (planner/shrink.py)."""
    job.shrinks = shrink_plans(job.graph, job.plan, alpha=job.freeze_alpha,
                               hardware=job.cost_args["hardware"] or job.graph.hardware,
                               partitioners=job.partitioners, steps=job.steps,
                               seed=job.seed)  # fmt: skip


def generate(job: Job, progress: Progress) -> None:
    """Write plan.json, report.html and the package into `out`, all or nothing; each
    shrink's package goes in the package's elastic/<name>/."""
    # Checked again: the folder may have gained files in the minutes since compile began.
    with output_folder(job.out, job.force, inputs=job.inputs, written=COMPILED) as tmp:
        write_report(tmp / "report.html", job.plan, job.sim, job.command)
        pkg = generate_package(job.traced, job.graph, job.plan, job.spec, tmp, job.command,
                               force=True)  # fmt: skip
        # One plan file: what `ftpipe simulate out/plan.json` reads is, byte for byte, what the
        # package runs (its transfers as wired, its paths relative to the package).
        shutil.copyfile(pkg / "plan.json", tmp / "plan.json")
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
        "update": update_rule(job.best.schedule),
        "best_sync": _cell_json(_best_exact(job)),
        "gpus": job.plan.gpus,
        "offload": {"mode": job.offload, "stages": [asdict(s.offload) for s in job.plan.stages]},
        "results": list(job.plan.competitors),
        "package": str(job.package),
        "output": str(job.out),
        "simulated": job.sim.summary(),
        "timings": timings,
        **_data_json(job),
    }


def _cell_json(cell) -> dict | None:
    if cell is None:
        return None
    return {"schedule": cell.schedule, "partitioner": cell.partitioner,
            "simulated_step_time_s": cell.step_s,
            "simulated_samples_per_s": cell.sim.samples_per_s}  # fmt: skip


def one_lines(job: Job, timings: dict) -> list[str]:
    graph, problem, plan, best, sim = job.graph, job.problem, job.plan, job.best, job.sim
    lines = [
        *_data_lines(job),
        f"{job.spec.name}: {len(graph.nodes):,} nodes, {graph.num_parameters:,} parameters, "
        f"{job.gpus} x {problem.hardware.name}, {problem.optimizer}, "
        f"{problem.micro_batches} micro-batches of {graph.meta.get('micro_batch')}",
        describe(problem.precision, problem.hardware),
        *([describe_frozen(graph)] if describe_frozen(graph) else []),
        matrix_table(list(plan.competitors)),
        f"winner: {best.partitioner} under {best.schedule} ({len(plan.stages)} stages, "
        f"{rate(sim.samples_per_s)} samples/s simulated, bubble {sim.bubble_fraction:.1%}); "
        + _update_words(best.schedule),
        *_exact_line(job),
        *(f"  {line}" for line in offload_report(plan, sim)),
        *_unlagged(job),
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


def _update_words(schedule: str) -> str:
    """Whether a schedule trains like one process, in words."""
    if update_rule(schedule) == "sync":
        return "synchronous: it trains exactly as one process would"
    return "asynchronous: some stages train on stale weights, unlike one process"


def _best_exact(job: Job):
    """The fastest fitting cell whose schedule is synchronous; None when there is none."""
    exact = [c for c in job.matrix if c.status == "ok" and update_rule(c.schedule) == "sync"]
    return min(exact, key=lambda c: c.step_s, default=None)


def _exact_line(job: Job) -> list[str]:
    """Under an asynchronous winner: what the best synchronous plan gives, and how to get it."""
    if update_rule(job.best.schedule) == "sync":
        return []
    exact = _best_exact(job)
    searched = any(update_rule(s) == "sync" for s in job.schedules)
    if exact is None:
        why = "fits" if searched else "was searched (--schedule)"
        return [f"  no synchronous schedule's plan {why}; --schedule sync plans only those"]
    slower = exact.step_s / job.best.step_s - 1
    return [
        f"  best synchronous plan: {exact.partitioner} under {exact.schedule}, "
        f"{rate(exact.sim.samples_per_s)} samples/s ({slower:.0%} slower per step); "
        "--schedule sync plans only the synchronous schedules"
    ]


def cluster_json(job: Job, timings: dict) -> dict:
    plan = job.plan
    return {
        "replicas": plan.replicas,
        "gpus_per_replica": plan.gpus,
        "winner": plan.partitioner,
        "gpus": plan.world,
        "planner": job.found.to_json(),
        "batch_note": _batch_note(job),
        "shard_optimizer": {
            "mode": job.plan.model.get("shard_optimizer", "none"),
            "stages": [s.id for s in job.plan.stages if s.shard_optimizer],
        },
        "package": str(job.package),
        "output": str(job.out),
        "simulated": job.sim.summary(),
        "timings": timings,
        **_data_json(job),
    }


def cluster_lines(job: Job, timings: dict) -> list[str]:
    hint = launch_hint(job.plan.to_dict())
    return [
        *_data_lines(job),
        *describe_shapes(job.found, job.cluster, _batch_note(job)),
        *(f"  {line}" for line in shard_lines(job.plan)),
        f"schedule {job.plan.schedule}: " + _update_words(job.plan.schedule),
        _wrote(job, timings),
        *_shrink_lines(job),
        f"run it on every node: cd {_quoted(job.out)} && torchrun {hint} -m {job.package.name}",
    ]


def _batch_note(job: Job) -> str | None:
    """The batch's note when it held the planner back (`cluster.batch_note`); none when
    --replicas or --micro-batches fixed the shapes."""
    if job.replicas or job.micro_batches:
        return None
    return batch_note(job.cluster, job.task.batch, job.task.micro_batch, job.plan.replicas)


def _data_lines(job: Job) -> list[str]:
    return [job.shapes.line()] if job.shapes else []


def _data_json(job: Job) -> dict:
    return {"data": job.shapes.to_json()} if job.shapes else {}


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
