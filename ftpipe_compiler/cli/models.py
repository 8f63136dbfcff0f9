"""`ftpipe models`: the models, heads, hardware and tasks that ship with ftpipe."""

from __future__ import annotations

import click
from ftpipe_runtime.models.heads import HEADS

from ..resources import config_names, load_config
from .echo import echo_json, json_option


@click.command()
@json_option("Print machine-readable JSON.")
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
    width = max(len(m["name"]) for m in rows["models"])
    for m in rows["models"]:
        hub = f" ({m['hub_id']})" if m.get("hub_id") else ""
        click.echo(
            f"  {m['name']:<{width}} {m['parameters'] / 1e6:>10,.1f} M params  "
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
