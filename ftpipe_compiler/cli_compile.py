"""`ftpipe compile`: trace, profile, plan under every partitioner x schedule, simulate each,
generate the winner (the search: `plan_search.best_plan`).

ftpipe compile --model t5-3b --gpus 8 -o out/t5-3b                 # --schedule auto
ftpipe compile --model t5-3b --gpus 8 --schedule sync              # plain mini-batch SGD only
ftpipe compile --model t5-3b --gpus 8 --schedule 1f1b,zb1p,zbv
# out/t5-3b/{plan.json, report.html, t5_3b_pipeline/}
"""

from __future__ import annotations

import json
import shutil
import sys
import time
from pathlib import Path

import click
from ftpipe_runtime.atomic import write_atomic
from ftpipe_runtime.replicas import launch_hint
from ftpipe_runtime.schedules import SCHEDULES
from tqdm import tqdm

from .cli import cli, command_line, echo_json
from .cli_commands import model_options
from .cli_plan import cluster_of, describe_shapes, plan_on_cluster
from .codegen import generate_package
from .costs.formulas import describe
from .costs.profilers import costed_graph
from .errors import FtpipeError
from .model.frozen import describe_frozen
from .output import check_writable, output_folder
from .partition import PARTITIONERS, problem_from_graph
from .plan_search import GROUPS, best_plan, schedule_names
from .planner.shrink import index_of, shrink_plans
from .simulate import write_report


def _schedules(ctx, param, value: str) -> list[str]:
    try:
        return schedule_names(value)
    except FtpipeError as e:
        raise click.BadParameter(str(e)) from None


@cli.command("compile")
@model_options
@click.option(
    "--gpus", "-g", type=click.IntRange(min=1), required=True, help="GPUs in the pipeline."
)
@click.option(
    "--schedule",
    default="auto",
    show_default=True,
    callback=_schedules,
    help=f"Schedules to plan for, the fastest simulated wins: {GROUPS['auto']} (auto), "
    f"{GROUPS['sync']} (sync), or a comma-separated list of {', '.join(SCHEDULES)}.",
)
@click.option(
    "--search-width",
    type=click.IntRange(min=1),
    default=1,
    show_default=True,
    help="Schedules (fastest by the quick partitioners' plans) under which the slower "
    "partitioners (mixed, acyclic, metis) also run.",
)
@click.option(
    "--partitioners",
    "-p",
    default=None,
    help=f"Comma-separated subset of {', '.join(PARTITIONERS)}.",
)
@click.option(
    "--optimizer",
    default=None,
    help="Optimizer whose state counts in memory (default: the task's).",
)
@click.option(
    "--micro-batches", type=click.IntRange(min=1), default=None, help="Micro-batches per step."
)
@click.option(
    "--steps",
    type=click.IntRange(min=2),
    default=20,
    show_default=True,
    help="Simulated steps per plan.",
)
@click.option("--seed", type=int, default=0, show_default=True)
@click.option(
    "--gpus-per-node",
    type=click.IntRange(min=1),
    default=None,
    help="GPUs in each node (default: the hardware file's node); the planner then chooses "
    "replicas x pipeline depth over the nodes.",
)
@click.option(
    "--cluster",
    "cluster_file",
    type=click.Path(dir_okay=False),
    default=None,
    help="A cluster description (JSON: gpu, gpus_per_node, intra_node, inter_node) to plan for.",
)
@click.option(
    "--replicas",
    type=click.IntRange(min=1),
    default=None,
    help="Data-parallel copies of the pipeline (default: 1, or the planner's choice with "
    "--gpus-per-node or --cluster).",
)
@click.option(
    "--freeze-training",
    "freeze_alpha",
    type=click.FloatRange(0, 1, min_open=True, max_open=True),
    default=None,
    metavar="ALPHA",
    help="Also write the plans a freeze-training run (PipeTransformer; run it with "
    "--freeze-alpha or --freeze-at) switches to as it freezes layers: the active layers on "
    "GPUS/2, GPUS/4 ... GPUs, the freed GPUs as data-parallel replicas, one halving per "
    "decision of the freeze rule with this alpha at its fastest (<package>/elastic/).",
)
@click.option(
    "-o",
    "--output",
    type=click.Path(file_okay=False),
    default=None,
    help="Output folder (default out/<model>).",
)
@click.option("--force", is_flag=True, help="Replace the output folder if it exists.")
@click.option("--json", "as_json", is_flag=True, help="Print machine-readable results.")
def compile_command(
    model,
    task,
    seq_len,
    micro_batch,
    hardware,
    granularity,
    profiler,
    gpus,
    schedule,
    search_width,
    partitioners,
    optimizer,
    micro_batches,
    steps,
    seed,
    gpus_per_node,
    cluster_file,
    replicas,
    freeze_alpha,
    output,
    force,
    as_json,
    **measured,
):
    """Compile a model into a pipeline package: the plan, a report and the package to torchrun."""
    t_start = time.perf_counter()
    out = Path(output or Path("out") / model.replace("/", "_").replace(":", "_"))
    check_writable(out, force)  # before minutes of work, not after
    command = command_line()
    phases = tqdm(
        total=4,
        desc="compile",
        file=sys.stderr,
        disable=None,
        leave=False,
        bar_format="{desc}: {n}/{total} {postfix}",
    )
    phases.set_postfix_str("trace and profile")
    timings = {}
    planned = gpus_per_node or cluster_file or replicas
    cluster = cluster_of(hardware, gpus, gpus_per_node, cluster_file, replicas) if planned else None
    if cluster_file:
        hardware = cluster.gpu.name  # the cluster's GPU is the one to cost
    t0 = time.perf_counter()
    cost_args = dict(model=model, task=task, hardware=hardware, micro_batch=micro_batch,
                     seq_len=seq_len, granularity=granularity, profile=profiler, **measured)  # fmt: skip
    spec, t, traced, graph = costed_graph(**cost_args)
    timings["trace_profile_s"] = time.perf_counter() - t0
    if micro_batches and measured.get("batch") and not planned:
        if micro_batches * t.micro_batch != t.batch:
            raise click.UsageError(
                f"--batch {t.batch} is not --micro-batches {micro_batches} x micro-batch "
                f"{t.micro_batch}; give one of the two"
            )
    phases.update()
    if planned:
        phases.set_postfix_str("plan replicas x depth")
        t0 = time.perf_counter()
        options = dict(schedule=schedule, replicas=replicas, micro_batches=micro_batches,
                       partitioners=_names(partitioners), optimizer=optimizer or t.optimizer,
                       seed=seed, steps=steps, progress=not as_json)  # fmt: skip
        found, traces = plan_on_cluster((spec, t, traced, graph), cluster, cost_args, options)
        timings["plan_s"] = time.perf_counter() - t0
        _, _, traced, graph = traces[found.candidate.micro_batch]
        sim = found.sim
        plan = found.plan.with_(
            competitors=found.competitors, simulated=sim.summary(), command=command
        )
        phases.update(2)
        shrinks = _shrinks(freeze_alpha, graph, plan, hardware, partitioners, steps, seed)
        pkg = _generate(out, force, phases, timings, traced, graph, plan, sim, spec, command,
                        shrinks)  # fmt: skip
        phases.close()
        timings["total_s"] = time.perf_counter() - t_start
        package = out / pkg.name
        if as_json:
            echo_json(
                {
                    "replicas": plan.replicas,
                    "gpus_per_replica": plan.gpus,
                    "winner": plan.partitioner,
                    "gpus": plan.world,
                    "planner": found.to_json(),
                    "package": str(package),
                    "output": str(out),
                    "simulated": sim.summary(),
                    "timings": timings,
                }
            )
            return
        for line in describe_shapes(found, cluster):
            click.echo(line)
        click.echo(
            f"wrote {out}/plan.json, {out}/report.html and the package {package} "
            f"in {timings['total_s']:.1f} s"
        )
        _say_shrinks(shrinks, package)
        hint = launch_hint(plan.to_json())
        click.echo(f"run it on every node: cd {out} && torchrun {hint} -m {pkg.name}")
        return
    phases.set_postfix_str("partition x schedule, simulated")
    problem = problem_from_graph(
        graph,
        gpus,
        hardware,
        "1f1b",  # any free-placement schedule: best_plan sets each cell's own
        optimizer or t.optimizer,
        micro_batches or t.micro_batches,
        seed,
    )
    t0 = time.perf_counter()
    best, matrix = best_plan(
        problem, schedule, _names(partitioners), steps=steps, width=search_width
    )
    timings["search_s"] = time.perf_counter() - t0
    phases.update(2)
    rows = [c.to_json() for c in matrix]
    winner_sim = best.sim
    plan = best.plan.with_(competitors=tuple(rows), simulated=winner_sim.summary(), command=command)
    shrinks = _shrinks(freeze_alpha, graph, plan, hardware, partitioners, steps, seed)
    pkg = _generate(out, force, phases, timings, traced, graph, plan, winner_sim, spec, command,
                    shrinks)  # fmt: skip
    phases.close()
    package = out / pkg.name
    timings["total_s"] = time.perf_counter() - t_start
    if as_json:
        echo_json(
            {
                "lower_bound_s": best.bound_s / problem.micro_batches,
                "winner": best.partitioner,
                "precision": problem.precision.name,
                "frozen": [p.name for p in graph.params if p.frozen],
                "schedule": best.schedule,
                "gpus": plan.gpus,
                "results": rows,
                "package": str(package),
                "output": str(out),
                "simulated": winner_sim.summary(),
                "timings": timings,
            }
        )
        return
    click.echo(
        f"{spec.name}: {len(graph.nodes):,} nodes, {graph.num_parameters:,} parameters, "
        f"{gpus} x {problem.hardware.name}, {problem.optimizer}, "
        f"{problem.micro_batches} micro-batches of {graph.meta.get('micro_batch')}"
    )
    click.echo(describe(problem.precision, problem.hardware))
    if describe_frozen(graph):
        click.echo(describe_frozen(graph))
    click.echo(matrix_table(rows))
    click.echo(
        f"winner: {best.partitioner} under {best.schedule} ({len(plan.stages)} stages, "
        f"{winner_sim.samples_per_s:.2f} samples/s simulated, bubble "
        f"{winner_sim.bubble_fraction:.1%})"
    )
    click.echo(
        f"wrote {out}/plan.json, {out}/report.html and the package {package} "
        f"in {timings['total_s']:.1f} s"
    )
    if plan.gpus < gpus:
        click.echo(
            f"note: the best plan uses {plan.gpus} of the {gpus} GPUs asked for; the others "
            "would have no stage to run"
        )
    _say_shrinks(shrinks, package)
    click.echo(f"run it: cd {out} && torchrun --nproc_per_node {plan.gpus} -m {pkg.name}")


def _names(partitioners: str | None) -> list[str] | None:
    return [n.strip() for n in partitioners.split(",")] if partitioners else None


def _shrinks(alpha, graph, plan, hardware, partitioners, steps, seed):
    """--freeze-training: the shorter pipelines' plans (planner/shrink.py); () without it."""
    if alpha is None:
        return ()
    return shrink_plans(graph, plan, alpha=alpha, hardware=hardware or graph.hardware,
                        partitioners=_names(partitioners), steps=steps, seed=seed)  # fmt: skip


def _say_shrinks(shrinks, package) -> None:
    for s in shrinks:
        click.echo(
            f"freeze training: from {s.frozen} frozen layers on {s.plan.replicas} replicas x "
            f"{s.plan.gpus} GPUs ({package}/elastic/{s.name})"
        )


def _generate(out, force, phases, timings, traced, graph, plan, sim, spec, command, shrinks=()):
    """Write plan.json, report.html and the package into `out`, all or nothing; each
    shrink's package goes in the package's elastic/<name>/."""
    phases.set_postfix_str("generate")
    t0 = time.perf_counter()
    with output_folder(out, force) as tmp:
        plan.save(tmp / "plan.json")
        write_report(tmp / "report.html", plan, sim, command)
        pkg = generate_package(traced, graph, plan, spec, tmp, command, force=True)
        for s in shrinks:
            sub = generate_package(traced, graph, s.plan, spec, tmp / "_elastic" / s.name,
                                   command, force=True)  # fmt: skip
            (pkg / "elastic").mkdir(exist_ok=True)
            sub.rename(pkg / "elastic" / s.name)
        if shrinks:
            shutil.rmtree(tmp / "_elastic")  # emptied: each shrink moved into the package
            write_atomic(pkg / "elastic" / "index.json", json.dumps(index_of(shrinks), indent=1))
    timings["generate_s"] = time.perf_counter() - t0
    phases.update()
    return pkg


def matrix_table(rows: list[dict]) -> str:
    """The partitioner x schedule cells that gave a plan, with simulated figures; the others
    (and why) are in the report and --json."""
    head = (
        f"{'schedule':<12} {'update':<6} {'partitioner':<11} {'s/step':>9} {'samples/s':>10} "
        f"{'bubble':>6} {'max GiB':>7} {'search s':>8}  fits"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        if r["simulated_step_time_s"] is None:
            continue
        lines.append(
            f"{r['schedule']:<12} {r['update']:<6} {r['partitioner']:<11} "
            f"{r['simulated_step_time_s']:>9.4g} {r['simulated_samples_per_s']:>10.2f} "
            f"{r['bubble_fraction']:>6.1%} {r['max_memory_bytes'] / 2**30:>7.2f} "
            f"{r['search_seconds']:>8.2f}  "
            + ("yes" if r["status"] == "ok" else f"no: {r['note']}")
        )
    others = [r for r in rows if r["simulated_step_time_s"] is None]
    if others:
        counts = {}
        for r in others:
            counts[r["status"]] = counts.get(r["status"], 0) + 1
        what = ", ".join(f"{n} {k}" for k, n in counts.items())
        lines.append(f"{len(others)} more cells without a plan ({what}): see report.html")
    return "\n".join(lines)
