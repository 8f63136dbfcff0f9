"""`ftpipe simulate plan.json`: throughput, bubbles, memory per GPU, and an HTML report.

ftpipe simulate plan.json                              # the plan under its own schedule
ftpipe simulate plan.json --schedule gpipe,1f1b,2bw    # schedules side by side
ftpipe simulate ftpipe.json wpipe.json                 # plans side by side
ftpipe simulate plan.json --schedule mine.csv          # per-GPU actions from a file
"""

from __future__ import annotations

import click
from ftpipe_runtime.atomic import check_writable_file
from ftpipe_runtime.errors import unknown_name
from ftpipe_runtime.schedules import SCHEDULES

from ..output import check_apart
from ..plan import Plan, describe_remat
from ..simulate import compare, simulate, table
from ..simulate.measured import load_measured
from ..simulate.network import shard_lines
from ..simulate.report import compare_line, write_report
from ..simulate.simulator import offload_report
from ..units import mib, rate
from .echo import echo_json, echo_lines
from .options import json_option, micro_batches_option, steps_option

DEFAULT_STEPS = 10


@click.command("simulate")
@click.argument("plan_files", metavar="PLAN.json...", nargs=-1, type=click.Path(dir_okay=False))
@click.option(
    "--schedule",
    default=None,
    help=f"Pipeline schedule: {', '.join(SCHEDULES)}, or a .csv of per-GPU actions; "
    "several, comma-separated, to compare them (default: each plan's).",
)
@micro_batches_option("Micro-batches per optimizer step (default: the plan's).", "-M")
@steps_option(
    None,
    1,
    "Optimizer steps to simulate; the last half is the steady state (default: as many as "
    "`compile` simulated the plan for, so both print the same figures; else 10).",
)
@click.option(
    "--report",
    type=click.Path(dir_okay=False),
    default=None,
    help="Write an HTML report (timeline, memory and utilisation per GPU) here (default: none).",
)
@click.option(
    "--compare",
    "trace",
    type=click.Path(dir_okay=False),
    default=None,
    help="A run's trace (the package's --trace FILE): its measured step time and timeline "
    "beside the simulated ones (its schedule and micro-batches unless given; default: none).",
)
@json_option("Print machine-readable JSON.")
def simulate_command(plan_files, schedule, micro_batches, steps, report, trace, as_json):
    """Simulate a plan: step time, samples/s, bubble, and per GPU busy time and memory.

    With several plans or schedules, print them side by side instead."""
    if not plan_files:
        raise click.UsageError("give a plan file (from ftpipe compile or ftpipe partition)")
    names = _schedule_names(schedule)
    one = len(plan_files) == 1 and len(names) == 1
    if report:
        if not one:
            raise click.UsageError("--report draws one plan under one schedule; give one of each")
        check_writable_file(report, "the report")  # before the simulation, not after
        csv = names[0] if names[0] and names[0].lower().endswith(".csv") else None
        read = {"the plan": plan_files[0], "the trace": trace, "the schedule": csv}
        check_apart(report, read, "choose another file with --report", name=f"the report {report}")
    if trace and not one:
        raise click.UsageError("--compare sets one run beside one plan under one schedule")
    plans = [(f, Plan.load(f)) for f in plan_files]
    steps = steps or _compiled_steps(plans[0][1])
    run = load_measured(trace, plans[0][1].gpus) if trace else None
    if run is not None:  # simulate what ran
        names = [names[0] or run.schedule or None]
        micro_batches = micro_batches or run.micro_batches
    if not one:
        runs = [(f, plan, name or plan.schedule) for f, plan in plans for name in names]
        rows = compare(runs, steps, micro_batches)
        if as_json:
            echo_json([row.to_json() for row in rows])
        else:
            click.echo(table(rows))
        return
    plan_file, plan = plans[0]
    schedule = names[0]
    result = simulate(plan, schedule, micro_batches, steps)
    if report:
        command = " ".join(
            ["ftpipe simulate", plan_file]
            + ([f"--schedule {schedule}"] if schedule else [])
            + ([f"--micro-batches {micro_batches}"] if micro_batches else [])
            + [f"--steps {steps}", f"--report {report}"]
        )
        write_report(report, plan, result, command, run)
    if as_json:
        extra = {"measured": run.summary(), "error": run.error(result)} if run else {}
        echo_json({**result.summary(), "remat_saved_bytes": plan.remat_saved_bytes, **extra})
        return
    echo_lines(_lines(plan, result, steps, run))
    if report:
        click.echo(f"\nreport: {report}")


def _compiled_steps(plan: Plan) -> int:
    """The steps `compile` simulated its winner for (a search simulates as few as show the
    steady state: `steady_steps`), so that `simulate` of its plan prints the same figures;
    10 for a plan that does not say (`ftpipe partition`'s, or one written before 2026-11-30)."""
    return int((plan.simulated or {}).get("steps") or DEFAULT_STEPS)


def _schedule_names(schedule: str | None) -> list[str | None]:
    """--schedule as names ([None]: each plan's own), each a schedule or a .csv file."""
    names = [n.strip() for n in schedule.split(",") if n.strip()] if schedule else [None]
    for name in names:
        if name is not None and name not in SCHEDULES and not name.lower().endswith(".csv"):
            raise click.BadParameter(
                unknown_name("schedule", name, SCHEDULES, " or give a .csv"),
                param_hint="'--schedule'",
            )
    return names


def _lines(plan: Plan, result, steps: int, run) -> list[str]:
    """One plan's simulation for people: the step, then each GPU's busy time and memory."""
    model = plan.model.get("spec") or plan.model.get("name") or "plan"
    hardware = plan.model.get("hardware") or "GPUs"
    width = f"{plan.replicas} replicas of " if plan.replicas > 1 else ""
    sent = sum(g.bytes_sent for g in result.gpus)
    lines = [
        f"{model} on {width}{plan.gpus} x {hardware}: {result.schedule} schedule, "
        f"{result.micro_batches} micro-batches of {result.micro_batch_size} per step, "
        f"{len(plan.stages)} stages, {steps} steps simulated",
        f"  step time   {result.step_time_s:10.4f} s   (plan estimate "
        f"{plan.period_s * result.micro_batches:.4f} s)",
        f"  samples/s   {rate(result.samples_per_s):>10}",
        f"  bubble      {100 * result.bubble_fraction:10.1f} %",
        f"  sent        {mib(sent):10.2f} MiB per step (all GPUs)",
    ]
    if describe_remat(plan):
        lines.append(f"  {describe_remat(plan)}")
    lines += [f"  {line}" for line in offload_report(plan, result)]
    lines += [f"  {line}" for line in shard_lines(plan)]
    if run is not None:
        lines.append(f"  {compare_line(run, result)}")
    lines.append("\n  GPU   busy   memory GiB / capacity   headroom   stages")
    for g in result.gpus:
        flag = "  over capacity" if not g.fits else ""
        stages = ", ".join(map(str, g.stages)) or "-"
        lines.append(
            f"  {g.gpu:>3} {100 * g.busy_fraction:5.1f} %   {g.peak_memory_bytes / 2**30:7.2f} / "
            f"{g.memory_bytes / 2**30:<7.2f}   {g.headroom_bytes / 2**30:8.2f}   {stages}{flag}"
        )
    return lines
