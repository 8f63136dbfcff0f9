"""`ftpipe partition graph.json --gpus 8`: let the partitioners compete on a costed graph.

`problem_from_graph` lives in `ftpipe_compiler.partition` (importable without the CLI); it is
re-exported here for `cli_compile`.
"""

from __future__ import annotations

import click
from ftpipe_runtime.atomic import check_writable_file
from ftpipe_runtime.schedules import SCHEDULES

from .cli import cli, command_line, echo_json
from .graph.opgraph import OpGraph
from .partition import PARTITIONERS, Result, pick_best, problem_from_graph, run_partitioners


def _names(value: str | None) -> list[str] | None:
    if not value:
        return None
    return [n.strip() for n in value.split(",") if n.strip()]


@cli.command()
@click.argument("graph_file", metavar="GRAPH.json", type=click.Path(dir_okay=False))
@click.option(
    "--gpus",
    "-g",
    type=click.IntRange(min=1),
    required=True,
    help="Number of GPUs in the pipeline.",
)
@click.option(
    "--hardware", default=None, help="GPU spec for memory and links (default: the graph's)."
)
@click.option(
    "--schedule",
    type=click.Choice(sorted(SCHEDULES)),
    default="ftpipe",
    show_default=True,
    help=f"Pipeline schedule to plan for: {', '.join(SCHEDULES)}.",
)
@click.option(
    "--optimizer",
    default=None,
    help="Optimizer whose state counts in memory (default: the task's).",
)
@click.option(
    "--micro-batches",
    type=click.IntRange(min=1),
    default=None,
    help="Micro-batches per step (default: task batch / micro-batch).",
)
@click.option(
    "--partitioners",
    "-p",
    default=None,
    help=f"Comma-separated subset of {', '.join(PARTITIONERS)}.",
)
@click.option("--seed", type=int, default=0, show_default=True)
@click.option(
    "-o",
    "--output",
    type=click.Path(dir_okay=False),
    default=None,
    help="Write the winning plan here.",
)
@click.option("--json", "as_json", is_flag=True, help="Print machine-readable results.")
def partition(
    graph_file,
    gpus,
    hardware,
    schedule,
    optimizer,
    micro_batches,
    partitioners,
    seed,
    output,
    as_json,
):
    """Run the partitioners on a costed graph (from `ftpipe profile -o`) and keep the best plan."""
    if output:
        check_writable_file(output, "the plan")  # before partitioning, not after
    graph = OpGraph.load(graph_file)
    problem = problem_from_graph(graph, gpus, hardware, schedule, optimizer, micro_batches, seed)
    results = run_partitioners(problem, _names(partitioners))
    best = pick_best(results)
    if output:
        plan = best.plan.with_(
            competitors=tuple(r.to_json() for r in results), command=command_line()
        )
        plan.save(output)
    if as_json:
        echo_json(
            {
                "lower_bound_s": problem.lower_bound(),
                "winner": best.partitioner,
                "results": [r.to_json() for r in results],
            }
        )
        return
    click.echo(
        f"{graph.model}: {len(graph.nodes):,} nodes on {gpus} x {problem.hardware.name}, "
        f"schedule {schedule}, {problem.optimizer}, {problem.micro_batches} micro-batches"
    )
    click.echo(table(results, problem.lower_bound()))
    click.echo(f"best: {best.partitioner}" + (f" -> wrote {output}" if output else ""))


def table(results: list[Result], lower_bound: float) -> str:
    head = (
        f"{'partitioner':<11} {'period ms':>10} {'speedup':>8} {'stages':>6} {'max GiB':>8} "
        f"{'comm MB':>9} {'search s':>8}  feasible"
    )
    rows = [head, "-" * len(head)]
    for r in results:
        d = r.to_json()
        if r.plan is None:
            rows.append(
                f"{r.partitioner:<11} {'-':>10} {'-':>8} {'-':>6} {'-':>8} {'-':>9} "
                f"{r.search_seconds:>8.2f}  no: {r.error}"
            )
            continue
        rows.append(
            f"{r.partitioner:<11} {d['period_s'] * 1e3:>10.2f} {d['expected_speedup']:>8.2f} {d['stages']:>6} "
            f"{d['max_memory_bytes'] / 2**30:>8.2f} {d['comm_bytes'] / 1e6:>9.1f} {r.search_seconds:>8.2f}  "
            + ("yes" if r.feasible else f"no: {r.error}")
        )
    rows.append(f"{'lower bound':<11} {lower_bound * 1e3:>10.2f}")
    return "\n".join(rows)
