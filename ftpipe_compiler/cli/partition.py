"""`ftpipe partition graph.json --gpus 8`: let the partitioners compete on a costed graph."""

from __future__ import annotations

import click
from ftpipe_runtime.atomic import check_writable_file
from ftpipe_runtime.schedules import SCHEDULES

from ..graph.opgraph import OpGraph
from ..output import check_apart
from ..partition import pick_best, problem_from_graph, run_partitioners
from .echo import command_line, echo_json
from .options import (
    json_option,
    micro_batches_option,
    names,
    optimizer_option,
    output_file_option,
    partitioners_option,
    seed_option,
)
from .tables import partition_table


@click.command()
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
@optimizer_option
@micro_batches_option("Micro-batches per step (default: task batch / micro-batch).")
@partitioners_option
@seed_option
@output_file_option("Write the winning plan here (default: print the table only).")
@json_option()
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
        check_apart(
            output,
            {"the graph": graph_file},
            "choose another file with -o",
            name=f"the plan {output}",
        )
    graph = OpGraph.load(graph_file)
    problem = problem_from_graph(graph, gpus, hardware, schedule, optimizer, micro_batches, seed)
    results = run_partitioners(problem, names(partitioners))
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
    click.echo(partition_table(results, problem.lower_bound()))
    click.echo(f"best: {best.partitioner}" + (f" -> wrote {output}" if output else ""))
