"""`ftpipe compile`: trace, profile, plan under every partitioner x schedule, simulate each,
generate the winner (the search: `planner.matrix.search_matrix`; the phases and what it
prints: compile_phases.py).

ftpipe compile --model t5-3b --gpus 8 -o out/t5-3b                 # --schedule auto
ftpipe compile --model t5-3b --gpus 8 --schedule sync              # plain mini-batch SGD only
ftpipe compile --model t5-3b --gpus 8 --schedule 1f1b,zb1p,zbv
# out/t5-3b/{plan.json, report.html, t5_3b_pipeline/}
"""

from __future__ import annotations

from pathlib import Path

import click
from ftpipe_runtime.data.text import TextOptions
from ftpipe_runtime.schedules import SCHEDULES
from ftpipe_runtime.spec.plan import OFFLOAD_STEPS

from ..errors import FtpipeError
from ..model.data_shapes import SAMPLES, DataRequest
from ..output import COMPILED, check_writable
from ..planner.matrix import GROUPS, schedule_names
from ..planner.offload import MODES as OFFLOAD_MODES
from ..planner.offload import SHARD_MODES
from .cluster import cluster_of
from .compile_phases import Job, pipeline_for
from .driver import drive
from .echo import command_line
from .options import (
    FiniteFloatRange,
    json_option,
    micro_batches_option,
    model_folder,
    names,
    optimizer_option,
    partitioners_option,
    seed_option,
    steps_option,
    traced_options,
)


def _folder_name(model: str) -> str:
    """out/<this>: the --model spec as one folder name inside out/ (a path's separators,
    colons and unprintable characters as underscores, never `.` or `..`)."""
    name = "".join(c if c.isprintable() and c not in "/\\:" else "_" for c in model)
    return name.lstrip(".") or "model"


def _schedules(ctx, param, value: str) -> list[str]:
    try:
        return schedule_names(value)
    except FtpipeError as e:
        raise click.BadParameter(str(e)) from None


_TEXT = ("text_field", "prompt_field", "target_field", "chat_field", "chat_template")


def _data_options(f):
    """--data FILE and how to read it (as the package reads it): the lengths from the data."""
    options = (
        click.option(
            "--data",
            type=click.Path(dir_okay=False),
            default=None,
            help="A text file to fine-tune on (.jsonl/.json/.csv/.parquet/.txt): set --seq-len "
            "(and --target-len) from its token lengths, tokenized by the model folder's "
            f"tokenizer (at most {SAMPLES} samples, drawn at random); an explicit length wins. "
            "(default: none, the task's lengths)",
        ),
        click.option(
            "--len-percentile",
            type=FiniteFloatRange(0, 100, min_open=True),
            default=99.0,
            show_default=True,
            help="With --data: the share of samples (nearest rank, %) the lengths fit; "
            "rounded up to a multiple of 8.",
        ),
        click.option(
            "--text-field",
            default=None,
            help="With --data: the field of the text (default: text).",
        ),
        click.option(
            "--prompt-field",
            default=None,
            help="With --data: prompts (with targets; default: none).",
        ),
        click.option("--target-field", default=None, help="With --data: targets (default: none)."),
        click.option(
            "--chat-field", default=None, help="With --data: chat messages (default: none)."
        ),
        click.option(
            "--chat-template",
            default=None,
            help="With --data: a Jinja chat template (default: the tokenizer's).",
        ),
        click.option(
            "--pack",
            is_flag=True,
            help="Trace a causal LM for packed rows whose documents stay apart (position ids "
            "restart per document, attention never crosses one; run the package with --pack); "
            "with --data, the length stays the task's (default: off).",
        ),
    )
    for o in reversed(options):
        f = o(f)
    return f


def _data_request(options: dict) -> DataRequest | None:
    """Takes the data options out of `options` (the rest, --pack too, are costed_graph's)."""
    path, percentile = options.pop("data"), options.pop("len_percentile")
    text = TextOptions(**{k: options.pop(k) for k in _TEXT}, pack=options["pack"])
    if path is None:
        given = next((k for k, v in text.to_json().items() if v and k != "pack"), None)
        if given:
            flag = "--" + given.replace("_", "-")
            raise click.UsageError(f"{flag} says how to read --data FILE; pass --data")
        return None
    return DataRequest(path, text, percentile)


@click.command("compile")
@traced_options
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
    "partitioners (mixed, acyclic, metis) also run (on a cluster: per shape, schedules "
    "and recompute together).",
)
@click.option(
    "--jobs",
    "-j",
    type=click.IntRange(min=1),
    default=None,
    help="Processes that search the partitioner x schedule matrix (on a cluster, every "
    "shape's); the plan is the same whatever the number (default: one per core).",
)
@partitioners_option
@optimizer_option
@micro_batches_option("Micro-batches per step (default: the task's batch / micro-batch).")
@steps_option(
    20,
    2,
    "Simulated steps per plan, at most: steps of many micro-batches show the steady state "
    "sooner (a search simulates at least 160 micro-batches and 2 steps).",
)
@seed_option
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
    help="A cluster description (JSON: gpu, gpus_per_node, intra_node, inter_node) to plan for "
    "(default: one pipeline, or the hardware file's nodes with --gpus-per-node).",
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
    type=FiniteFloatRange(0, 1, min_open=True, max_open=True),
    default=None,
    metavar="ALPHA",
    help="Also write the plans a freeze-training run (PipeTransformer; run it with "
    "--freeze-alpha or --freeze-at) switches to as it freezes layers: the active layers on "
    "GPUS/2, GPUS/4 ... GPUs, the freed GPUs as data-parallel replicas, one halving per "
    "decision of the freeze rule with this alpha at its fastest (<package>/elastic/; "
    "default: none).",
)
@click.option(
    "-o",
    "--output",
    type=click.Path(file_okay=False),
    default=None,
    help="Output folder (default out/<model>).",
)
@click.option("--force", is_flag=True, help="Replace the output folder if it exists.")
@click.option(
    "--offload",
    type=click.Choice(list(OFFLOAD_MODES)),
    default="auto",
    show_default=True,
    help="What stages keep in host memory: auto offloads per stage only what a GPU needs "
    "when nothing fits without (optimizer state first where cheaper, or activations); none "
    "never; optimizer or activations on every stage. One pipeline only (not with "
    "--gpus-per-node, --cluster or --replicas).",
)
@click.option(
    "--offload-step",
    type=click.Choice(list(OFFLOAD_STEPS)),
    default="exact",
    show_default=True,
    help="Where an offloaded stage's CPU step, run beside its GPU's next actions, lands: exact "
    "where the stage's weights are next read (the update without offload); lagged at the "
    "stage's next step, under the ftpipe schedule only (its actions read weights one step "
    "older; the whole CPU step hidden).",
)
@click.option(
    "--shard-optimizer",
    "shard",
    type=click.Choice(list(SHARD_MODES)),
    default="auto",
    show_default=True,
    help="Shard a stage's fp32 masters and optimizer state across the data-parallel replicas "
    "(ZeRO-1: each keeps 1/replicas; gradients reduce-scattered, weights all-gathered): auto "
    "only where a GPU needs it to fit; none never; always every stage that trains. With "
    "replicas only (--gpus-per-node, --cluster or --replicas); not with --freeze-training "
    "or Adafactor.",
)
@_data_options
@json_option()
def compile_command(*, model, hardware, gpus, schedule, search_width, jobs, partitioners, optimizer,
                    micro_batches, steps, seed, gpus_per_node, cluster_file, replicas,
                    freeze_alpha, output, force, offload, offload_step, shard, as_json,
                    **cost_options):  # fmt: skip
    """Compile a model into a pipeline package: the plan, a report and the package to torchrun."""
    data = _data_request(cost_options)
    out = Path(output or Path("out") / _folder_name(model))
    inputs = {
        "the model folder": model_folder(model),
        "the data": data and data.path,
        "the chat template": data and data.text.chat_template,
        "the cluster file": cluster_file,
    }
    check_writable(out, force, inputs, COMPILED)  # before minutes of work, not after
    planned = gpus_per_node or cluster_file or replicas
    if planned and offload in ("optimizer", "activations"):
        # The runtime cannot sum replicas' gradients where the masters are on the host (CUDA).
        raise click.UsageError(
            f"--offload {offload} plans one pipeline; leave out --gpus-per-node, --cluster and "
            "--replicas, or --offload"
        )
    if shard == "always" and not planned:
        raise click.UsageError(
            "--shard-optimizer always shards across data-parallel replicas; give --replicas, "
            "--gpus-per-node or --cluster, or leave it out"
        )
    if shard == "always" and freeze_alpha is not None:
        raise click.UsageError(
            "--shard-optimizer always: a package that freezes layers (--freeze-training) "
            "does not shard; leave one of them out"
        )
    cluster = cluster_of(hardware, gpus, gpus_per_node, cluster_file, replicas) if planned else None
    if cluster_file:
        hardware = cluster.gpu.name  # the cluster's GPU is the one to cost
    # cost_options: task, shapes, granularity, profiler and the measured profiler's options
    cost_options["profile"] = cost_options.pop("profiler")
    job = Job(
        out=out,
        force=force,
        command=command_line(),
        inputs=inputs,
        cost_args=dict(model=model, hardware=hardware, **cost_options),
        gpus=gpus,
        schedules=schedule,
        search_width=search_width,
        jobs=jobs,
        partitioners=names(partitioners),
        optimizer=optimizer,
        micro_batches=micro_batches,
        replicas=replicas,
        steps=steps,
        seed=seed,
        freeze_alpha=freeze_alpha,
        cluster=cluster,
        data=data,
        offload=offload,
        offload_step=offload_step,
        shard=shard,
    )
    drive(pipeline_for(job), job, as_json=as_json)
