"""Options more than one command takes, each written once.

`traced_options` (profile, compile) is what to trace and how to cost it, in three groups:
the model and its shapes, the costs, the measured profiler. `head`, `target_len` and
`batch`, and the measured profiler's `device`, `memory_limit_gb`, `repeats` and `cache`,
arrive as keywords for `costed_graph` (which hands the last four to `measured_costs`).
"""

from __future__ import annotations

import math
import os

import click
from ftpipe_runtime.errors import unknown_name
from ftpipe_runtime.models import HEADS
from ftpipe_runtime.models.lora import LoraSpec
from ftpipe_runtime.train.precision import PRECISIONS

from ..costs.measured import DEVICES
from ..costs.profilers import GRANULARITIES, PROFILERS
from ..partition import PARTITIONERS
from ..resources import config_names
from .echo import json_option  # noqa: F401 - the commands' options in one place
from .hardware import DEFAULT as DEFAULT_HARDWARE
from .hardware import default_hardware

__all__ = [
    "FiniteFloatRange",
    "json_option",
    "micro_batches_option",
    "model_folder",
    "names",
    "optimizer_option",
    "output_file_option",
    "partitioners_option",
    "seed_option",
    "steps_option",
    "traced_options",
]


def _all(*options):
    """One decorator applying `options` in the order listed (as --help shows them)."""

    def apply(f):
        for o in reversed(options):
            f = o(f)
        return f

    return apply


def names(value: str | None) -> list[str] | None:
    """A comma-separated option as a list of names; None when not given."""
    if not value:
        return None
    return [n.strip() for n in value.split(",") if n.strip()] or None


class FiniteFloatRange(click.FloatRange):
    """click.FloatRange that refuses nan and inf as usage errors: nan passes every range
    check (each comparison is False) and both fail deep in the work as an unexpected error."""

    def convert(self, value, param, ctx):
        number = click.FLOAT.convert(value, param, ctx)
        if not math.isfinite(number):
            self.fail(f"{value} is not a finite number", param, ctx)
        return super().convert(number, param, ctx)


def model_folder(spec: str) -> str | None:
    """--model when it is a folder here (a shipped name wins over a folder of that name, as
    `resolve_model` decides): an input no output may be, replace or (a file) lie in."""
    if "/" not in spec and "\\" not in spec and spec in config_names("models"):
        return None
    return spec if os.path.isdir(spec) else None


def _partitioners(ctx, param, value: str | None) -> str | None:
    """-p, refused as a usage error when it names a partitioner that does not exist."""
    for name in names(value) or ():
        if name not in PARTITIONERS:
            raise click.BadParameter(unknown_name("partitioner", name, PARTITIONERS))
    return value


seed_option = click.option(
    "--seed",
    type=int,
    default=0,
    show_default=True,
    help="Seed of the partitioners' random choices (METIS, tie-breaks): the same seed, the "
    "same plan.",
)
optimizer_option = click.option(
    "--optimizer",
    default=None,
    help="Optimizer whose state counts in memory (default: the task's).",
)
partitioners_option = click.option(
    "--partitioners",
    "-p",
    default=None,
    help=f"Comma-separated subset of {', '.join(PARTITIONERS)} (default: all).",
    callback=_partitioners,
)


def micro_batches_option(help: str, *short: str):
    return click.option(
        "--micro-batches", *short, type=click.IntRange(min=1), default=None, help=help
    )


def steps_option(default: int | None, minimum: int, help: str):
    return click.option(
        "--steps",
        type=click.IntRange(min=minimum),
        default=default,
        show_default=default is not None,
        help=help,
    )


def output_file_option(help: str):
    return click.option("-o", "--output", type=click.Path(dir_okay=False), default=None, help=help)


def _hardware(ctx, param, value: str | None) -> str:
    """--hardware, or the default: looked for only when not given (it may start CUDA)."""
    if value is not None and value not in config_names("hardware"):
        raise click.BadParameter(unknown_name("hardware", value, config_names("hardware")))
    return value or default_hardware()


def _lora_checked(ctx, param, value: str | None) -> str | None:
    """--lora's text, refused as a usage error when it does not parse."""
    if value:
        try:
            LoraSpec.parse(value)
        except ValueError as e:
            raise click.BadParameter(str(e)) from None
    return value


_model = _all(
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
        help="Tokens per sequence (encoder side; default: the task's).",
    ),
    click.option(
        "--target-len",
        type=click.IntRange(min=1),
        default=None,
        help="Decoder tokens of a seq2seq LM (default: the task's).",
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
)

_costs = _all(
    click.option(
        "--hardware",
        default=None,
        callback=_hardware,
        help="The GPU to cost and plan for: a hardware file (ftpipe models; default: this "
        f"machine's GPU when a file describes it, else {DEFAULT_HARDWARE}).",
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
        "requires_grad counts too (default: nothing frozen).",
    ),
    click.option(
        "--lora",
        default=None,
        metavar="SPEC",
        callback=_lora_checked,
        help="Train LoRA adapters (peft) on a frozen base: r=16,alpha=32,targets=q_proj,"
        "v_proj[,dropout=0.05]; export writes peft's adapter folder (default: train every "
        "weight).",
    ),
    click.option(
        "--fuse-loss/--no-fuse-loss",
        default=True,
        show_default=True,
        help="Make an LM head and its cross-entropy one op (ftpipe_runtime.stage.fused_loss: one "
        "logits-sized tensor per micro-batch instead of four, the same loss and gradients); "
        "--no-fuse-loss keeps the model's own ops.",
    ),
    click.option(
        "--granularity",
        type=click.Choice(GRANULARITIES),
        default="op",
        show_default=True,
        help="Graph nodes: op, one per operator, or layer, one per run of a layer's operators "
        "(fewer nodes: faster to plan, coarser cuts).",
    ),
    click.option(
        "--profile",
        "profiler",
        type=click.Choice(PROFILERS),
        default="analytic",
        show_default=True,
        help="analytic: FLOPs and bytes on a roofline; measured: time every block.",
    ),
)

_measured = _all(
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
        type=FiniteFloatRange(min=0, min_open=True),
        default=None,
        help="GB a measured block may use on the device; a bigger block is an error "
        "(default: no limit).",
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
)

traced_options = _all(_model, _costs, _measured)
