"""`ftpipe models` and `ftpipe profile`."""

from __future__ import annotations

import time

import click
from ftpipe_runtime.atomic import check_writable_file
from ftpipe_runtime.models import HEADS
from ftpipe_runtime.models.lora import LoraSpec
from ftpipe_runtime.precision import PRECISIONS

from .cli import cli, echo_json
from .costs.measured import DEVICES
from .costs.profilers import GRANULARITIES, PROFILERS, costed_graph
from .resources import config_names, load_config


@cli.command()
@click.option("--json", "as_json", is_flag=True, help="Print machine-readable JSON.")
def models(as_json):
    """The models, hardware and tasks that ship with ftpipe."""
    rows = {
        kind: [load_config(kind, n) for n in config_names(kind)]
        for kind in ("models", "hardware", "tasks")
    }
    if as_json:
        echo_json(rows)
        return
    click.echo(
        "Models (--model NAME or its hub id; also any local HuggingFace folder, a hub id in the "
        "local HuggingFace cache, or package.module:function):"
    )
    for m in rows["models"]:
        hub = f" ({m['hub_id']})" if m.get("hub_id") else ""
        click.echo(
            f"  {m['name']:<13} {m['parameters'] / 1e6:>10,.1f} M params  "
            f"task {m['default_task']:<12} {m['description']}{hub}"
        )
    click.echo("\nHeads (--head NAME; by default the config's architectures decide):")
    for h in HEADS.values():
        click.echo(f"  {h.name:<24} task {h.default_task:<10} {h.description}")
    click.echo("\nHardware (--hardware NAME):")
    for h in rows["hardware"]:
        click.echo(
            f"  {h['name']:<12} {h['memory_bytes'] / 2**30:>5.0f} GiB  {h['peak_flops'] / 1e12:>6.1f} "
            f"TFLOP/s fp32 {h['peak_flops_16bit']['bfloat16'] / 1e12:>6.1f} bf16  "
            f"link {h['link_bandwidth'] / 1e9:>5.0f} GB/s  {h['description']}"
        )
    click.echo(
        "\nTasks (--task NAME; reshape with --seq-len, --target-len, --micro-batch, --batch):"
    )
    for t in rows["tasks"]:
        shape = f"seq {t['seq_len']}" + (
            f", target {t['target_len']}" if t.get("target_len") else ""
        )
        click.echo(
            f"  {t['name']:<12} {t['head']:<24} {shape:<20} micro-batch {t['micro_batch']:<3} "
            f"batch {t['batch']:<4} {t['optimizer']}"
        )


def _lora_checked(ctx, param, value: str | None) -> str | None:
    """--lora's text, refused as a usage error when it does not parse."""
    if value:
        try:
            LoraSpec.parse(value)
        except ValueError as e:
            raise click.BadParameter(str(e)) from None
    return value


def model_options(f):
    """Options shared by `profile` and `compile`: what to trace and how to cost it.

    `head`, `target_len` and `batch`, and the measured profiler's `device`, `memory_limit_gb`,
    `repeats` and `cache`, arrive as keywords for `costed_graph` (which hands the last four to
    `measured_costs`).
    """
    options = [
        click.option(
            "--model",
            "-m",
            required=True,
            help="Shipped name or its hub id (ftpipe models), a local HuggingFace folder, a hub "
            "id in the local HuggingFace cache, or module:function.",
        ),
        click.option(
            "--head",
            type=click.Choice(list(HEADS)),
            default=None,
            help="The model's head (default: the class in the config's architectures).",
        ),
        click.option(
            "--task",
            "-t",
            default=None,
            help="Task preset whose shapes to trace (default: the model's; ftpipe models).",
        ),
        click.option(
            "--seq-len",
            type=click.IntRange(min=1),
            default=None,
            help="Tokens per sequence (encoder side).",
        ),
        click.option(
            "--target-len",
            type=click.IntRange(min=1),
            default=None,
            help="Decoder tokens of a seq2seq LM.",
        ),
        click.option(
            "--micro-batch",
            "-b",
            type=click.IntRange(min=1),
            default=None,
            help="Sequences per micro-batch (default: the task's).",
        ),
        click.option(
            "--batch",
            type=click.IntRange(min=1),
            default=None,
            help="Sequences per optimizer step (default: the task's micro-batches).",
        ),
        click.option(
            "--hardware", default="rtx2080ti", show_default=True, help="GPU spec for the costs."
        ),
        click.option(
            "--dtype",
            "precision",
            type=click.Choice(list(PRECISIONS)),
            default="fp32",
            show_default=True,
            help="Training precision: bf16 and fp16 compute in 16 bits with fp32 master weights "
            "and optimizer state (fp16 with loss scaling); bf16-pure keeps everything in bf16.",
        ),
        click.option(
            "--freeze",
            default=None,
            metavar="REGEX",
            help="Freeze the parameters whose names match REGEX from their start (e.g. "
            "'encoder.block.[0-9]\\.'): no gradient, no optimizer state; stages with nothing "
            "trainable before them run forwards only. A module:function model's own "
            "requires_grad counts too.",
        ),
        click.option(
            "--lora",
            default=None,
            metavar="SPEC",
            callback=_lora_checked,
            help="Train LoRA adapters (peft) on a frozen base: r=16,alpha=32,targets=q_proj,"
            "v_proj[,dropout=0.05]; export writes peft's adapter folder.",
        ),
        click.option(
            "--granularity", type=click.Choice(GRANULARITIES), default="op", show_default=True
        ),
        click.option(
            "--profile",
            "profiler",
            type=click.Choice(PROFILERS),
            default="analytic",
            show_default=True,
            help="analytic: FLOPs and bytes on a roofline; measured: time every block.",
        ),
        click.option(
            "--device",
            type=click.Choice(sorted(DEVICES)),
            default="cpu",
            show_default=True,
            help="Where --profile measured times the blocks.",
        ),
        click.option(
            "--memory-limit",
            "memory_limit_gb",
            type=click.FloatRange(min=0, min_open=True),
            default=None,
            help="GB a measured block may use on the device; a bigger block is an error.",
        ),
        click.option(
            "--repeats",
            type=click.IntRange(min=1),
            default=3,
            show_default=True,
            help="Timed runs per block (median, after one warm-up).",
        ),
        click.option(
            "--cache/--no-cache",
            default=True,
            show_default=True,
            help="Reuse a cached measured profile; --no-cache profiles again.",
        ),
    ]
    for o in reversed(options):
        f = o(f)
    return f


@cli.command()
@model_options
@click.option(
    "-o",
    "--output",
    type=click.Path(dir_okay=False),
    default=None,
    help="Write the costed graph here.",
)
@click.option("--json", "as_json", is_flag=True, help="Print the summary as JSON.")
def profile(
    model, task, seq_len, micro_batch, hardware, granularity, profiler, output, as_json, **options
):
    """Trace a model into an operator graph and cost every node."""
    if output:
        check_writable_file(output, "the graph")  # before tracing, not after
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
        f"({graph.param_bytes / 2**30:.2f} GiB)"
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
