"""`ftpipe simulate plan.json`: throughput, bubbles, memory per GPU, and an HTML report."""

from __future__ import annotations

import click
from ftpipe_runtime.atomic import check_writable_file
from ftpipe_runtime.schedules import SCHEDULES

from .cli import cli, echo_json
from .partition.plan import Plan
from .simulate import simulate
from .simulate.report import write_report


@cli.command("simulate")
@click.argument("plan_file", metavar="PLAN.json", type=click.Path(dir_okay=False))
@click.option(
    "--schedule",
    type=click.Choice(sorted(SCHEDULES)),
    default=None,
    help="Pipeline schedule (default: the plan's).",
)
@click.option(
    "--micro-batches",
    "-M",
    type=click.IntRange(min=1),
    default=None,
    help="Micro-batches per optimizer step (default: the plan's).",
)
@click.option(
    "--steps",
    type=click.IntRange(min=1),
    default=10,
    show_default=True,
    help="Optimizer steps to simulate; the last half is the steady state.",
)
@click.option(
    "--report",
    type=click.Path(dir_okay=False),
    default=None,
    help="Write an HTML report (timeline, memory and utilisation per GPU) here.",
)
@click.option("--json", "as_json", is_flag=True, help="Print machine-readable JSON.")
def simulate_command(plan_file, schedule, micro_batches, steps, report, as_json):
    """Simulate a plan: step time, samples/s, bubble, and per GPU busy time and memory."""
    if report:
        check_writable_file(report, "the report")  # before the simulation, not after
    plan = Plan.load(plan_file)
    result = simulate(plan, schedule, micro_batches, steps)
    if report:
        command = " ".join(
            ["ftpipe simulate", plan_file]
            + ([f"--schedule {schedule}"] if schedule else [])
            + ([f"--micro-batches {micro_batches}"] if micro_batches else [])
            + [f"--steps {steps}", f"--report {report}"]
        )
        write_report(report, plan, result, command)
    if as_json:
        echo_json(result.summary())
        return
    model = plan.model.get("spec") or plan.model.get("name") or "plan"
    hardware = plan.model.get("hardware") or "GPUs"
    click.echo(
        f"{model} on {plan.gpus} x {hardware}: {result.schedule} schedule, "
        f"{result.micro_batches} micro-batches of {result.micro_batch_size} per step, "
        f"{len(plan.stages)} stages, {steps} steps simulated"
    )
    click.echo(
        f"  step time   {result.step_time_s:10.4f} s   (plan estimate "
        f"{plan.period_s * result.micro_batches:.4f} s)"
    )
    click.echo(f"  samples/s   {result.samples_per_s:10.2f}")
    click.echo(f"  bubble      {100 * result.bubble_fraction:10.1f} %")
    click.echo("\n  GPU   busy   memory GiB / capacity   stages")
    for g in result.gpus:
        flag = "  over capacity" if not g.fits else ""
        stages = ", ".join(map(str, g.stages)) or "-"
        click.echo(
            f"  {g.gpu:>3} {100 * g.busy_fraction:5.1f} %   {g.peak_memory_bytes / 2**30:7.2f} / "
            f"{g.memory_bytes / 2**30:<7.2f}      {stages}{flag}"
        )
    if report:
        click.echo(f"\nreport: {report}")
