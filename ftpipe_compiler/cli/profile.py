"""`ftpipe profile`: trace a model into an operator graph and cost every node.

ftpipe profile --model t5-3b --hardware v100-32gb -o graph.json
"""

from __future__ import annotations

import time

import click
from ftpipe_runtime.atomic import check_writable_file

from ..costs.profilers import costed_graph
from ..output import check_apart
from ..units import size
from .echo import echo_json
from .options import json_option, model_folder, output_file_option, traced_options


@click.command()
@traced_options
@output_file_option("Write the costed graph here (default: print the summary only).")
@json_option("Print the summary as JSON.")
def profile(
    model, task, seq_len, micro_batch, hardware, granularity, profiler, output, as_json, **options
):
    """Trace a model into an operator graph and cost every node."""
    if output:
        check_writable_file(output, "the graph")  # before tracing, not after
        check_apart(
            output,
            {"the model folder": model_folder(model)},
            "choose another file with -o",
            name=f"the graph {output}",
        )
    t0 = time.perf_counter()
    # `options` holds head, target_len and batch, and the measured profiler's device,
    # memory_limit_gb, repeats and cache: costed_graph's keywords.
    spec, t, _, graph = costed_graph(
        model, task, hardware, micro_batch, seq_len, granularity, profiler, **options
    )
    seconds = time.perf_counter() - t0
    if output:
        graph.save(output)
    fwd = sum(n.fwd_s for n in graph.nodes)
    bwd = sum(n.bwd_s for n in graph.nodes)
    top = sorted(graph.nodes, key=lambda n: -(n.fwd_s + n.bwd_s))[:5]
    summary = {
        "model": spec.name,
        "task": t.name,
        "micro_batch": graph.meta["micro_batch"],
        "granularity": graph.granularity,
        "profile": graph.profile,
        "hardware": graph.hardware,
        "nodes": len(graph.nodes),
        "edges": len(graph.edges),
        "parameters": graph.num_parameters,
        "parameter_bytes": graph.param_bytes,
        "forward_flops": graph.total_flops,
        "forward_s": fwd,
        "backward_s": bwd,
        "seconds": seconds,
        "biggest": [
            {"id": n.id, "scope": n.scope, "op": n.op, "fwd_s": n.fwd_s, "bwd_s": n.bwd_s}
            for n in top
        ],
    }
    if as_json:
        echo_json(summary)
        return
    click.echo(
        f"{spec.name} ({t.name}, micro-batch {summary['micro_batch']}, {graph.granularity} granularity, "
        f"{graph.profile} costs on {graph.hardware})"
    )
    click.echo(
        f"  nodes {len(graph.nodes):,}  edges {len(graph.edges):,}  parameters {graph.num_parameters:,} "
        f"({size(graph.param_bytes)})"
    )
    click.echo(
        f"  forward {graph.total_flops / 1e12:.3f} TFLOP, {fwd * 1e3:.1f} ms; backward {bwd * 1e3:.1f} ms "
        "per micro-batch"
    )
    click.echo("  biggest nodes:")
    for n in top:
        click.echo(f"    {n.id:<24} {n.op:<32} {(n.fwd_s + n.bwd_s) * 1e3:8.2f} ms  {n.scope}")
    if output:
        click.echo(f"wrote {output} ({seconds:.1f} s)")
