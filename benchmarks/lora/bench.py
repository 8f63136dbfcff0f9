"""Section `lora` of BENCHMARKS.md: LoRA and frozen layers in the plans (simulated).

    python -m benchmarks --sections lora --out /tmp/lora.md

1. Llama-3.1-8B (meta-device model from its config: nothing downloaded) on 4 x rtx4090,
   WikiText-2 shapes: full fine-tuning (bf16 with fp32 masters, and bf16-pure) against LoRA
   r=16 on q_proj,v_proj over a frozen bf16 base (no gradient, master or optimizer state for
   the base). Each row: the fastest plan that fits among the synchronous schedules x the quick
   partitioners (`planner.matrix.search_matrix`), its peak memory per GPU and simulated samples/s; a
   row with no plan that fits gives the bytes of weights, gradients and optimizer state alone
   per GPU (a floor no partition goes below).
2. GPT2-XL on 4 x rtx2080ti with the embeddings and the first 24 of its 48 blocks frozen
   (`--freeze`): the blocks each stage runs, with and without, and what the plan gains.
"""

from __future__ import annotations

import re
import time

from ftpipe_compiler.costs.profilers import costed_graph
from ftpipe_compiler.errors import InfeasibleError
from ftpipe_compiler.partition import problem_from_graph
from ftpipe_compiler.planner.matrix import CHEAP, search_matrix

ALONE = False  # it only computes: it may share the machine (benchmarks.sections)

GIB = 2**30
SCHEDULES = ["gpipe", "1f1b", "zb1p", "interleaved"]
LLAMA = ("llama-3.1-8b", "rtx4090", 4)
ROWS = [  # (label, --dtype, --lora)
    ("full fine-tuning, bf16 (fp32 masters)", "bf16", None),
    ("full fine-tuning, bf16-pure", "bf16-pure", None),
    ("LoRA r=16 q_proj,v_proj, bf16 base", "bf16", "r=16,alpha=32,targets=q_proj,v_proj"),
]
GPT2 = ("gpt2-xl", "rtx2080ti", 4)
FREEZE = r"transformer.wte|transformer.wpe|transformer.h.([0-9]|1[0-9]|2[0-3])\."


def _plan_row(graph, hardware: str, gpus: int) -> dict:
    problem = problem_from_graph(graph, gpus, hardware, "1f1b")
    static = sum(problem.static_bytes.values()) / gpus
    trainable = sum(p.bytes for p in graph.params if p.trainable)
    row = {"trainable_params": graph.num_parameters, "trainable_bytes": trainable,
           "static_floor_bytes_per_gpu": static, "memory_bytes": problem.memory}  # fmt: skip
    try:
        best, _ = search_matrix(problem, SCHEDULES, list(CHEAP), steps=10, progress=False)
    except InfeasibleError:
        return {**row, "feasible": False}
    plan, sim = best.plan, best.sim
    return {
        **row,
        "feasible": True,
        "schedule": best.schedule,
        "partitioner": best.partitioner,
        "samples_per_s": sim.samples_per_s,
        "memory_per_gpu_bytes": [plan.gpu_memory(g) for g in range(plan.gpus)],
        "forward_only_stages": sum(s.forward_only for s in plan.stages),
        "plan": plan,
    }


def _blocks(plan, graph) -> list[str]:
    """The transformer blocks each stage runs, as first-last."""
    out = []
    for s in plan.stages:
        found = sorted(
            {
                int(m.group(1))
                for n in s.nodes
                if (m := re.search(r"\.h\.(\d+)", graph.node[n].scope))
            }
        )
        out.append(f"{found[0]}-{found[-1]}" if found else "-")
    return out


def measure() -> dict:
    model, hardware, gpus = LLAMA
    rows = []
    for label, dtype, lora in ROWS:
        t0 = time.perf_counter()
        _, task, _, graph = costed_graph(
            model, hardware=hardware, precision=dtype, granularity="layer", lora=lora
        )
        row = _plan_row(graph, hardware, gpus)
        row.pop("plan", None)
        rows.append({"label": label, "dtype": dtype, "lora": lora, **row,
                     "seconds": time.perf_counter() - t0})  # fmt: skip
    model2, hw2, gpus2 = GPT2
    frozen = []
    for freeze in (None, FREEZE):
        _, _, _, graph = costed_graph(model2, hardware=hw2, granularity="layer", freeze=freeze)
        row = _plan_row(graph, hw2, gpus2)
        plan = row.pop("plan")
        frozen.append({"freeze": freeze, "blocks": _blocks(plan, graph), **row})
    return {"llama": {"model": model, "hardware": hardware, "gpus": gpus, "task": task.name,
                      "rows": rows}, "freeze": {"model": model2, "hardware": hw2, "gpus": gpus2,
                      "rows": frozen}}  # fmt: skip


def markdown(data: dict) -> str:
    ll, fz = data["llama"], data["freeze"]
    lines = [
        "## LoRA and frozen layers (simulated)",
        "",
        f"{ll['model']} on {ll['gpus']} x {ll['hardware']} ({ll['task']} shapes), fastest plan "
        f"that fits among {', '.join(SCHEDULES)} x the quick partitioners:",
        "",
        "| training | trainable params | fits | schedule / partitioner | peak GiB per GPU "
        "| floor GiB per GPU | samples/s |",
        "|---|---:|---|---|---|---:|---:|",
    ]
    for r in ll["rows"]:
        floor = r["static_floor_bytes_per_gpu"] / GIB
        if r["feasible"]:
            mem = " / ".join(f"{b / GIB:.1f}" for b in r["memory_per_gpu_bytes"])
            lines.append(
                f"| {r['label']} | {r['trainable_params'] / 1e6:,.1f} M | yes | {r['schedule']} / "
                f"{r['partitioner']} | {mem} | {floor:.1f} | {r['samples_per_s']:.2f} |"
            )
        else:
            lines.append(
                f"| {r['label']} | {r['trainable_params'] / 1e6:,.1f} M | no "
                f"({r['memory_bytes'] / GIB:.0f} GiB GPUs) | - | - | {floor:.1f} | - |"
            )
    lines += [
        "",
        "Floor: weights, gradients, fp32 masters and AdamW state divided evenly over the GPUs "
        "(no activations); a frozen bf16 base weight costs 2 B, nothing else.",
        "",
        f"{fz['model']} on {fz['gpus']} x {fz['hardware']}, blocks per stage (1F1B family, "
        "quick partitioners):",
        "",
        "| frozen | blocks per stage | forward-only stages | schedule / partitioner | samples/s |",
        "|---|---|---:|---|---:|",
    ]
    for r in fz["rows"]:
        what = f"`{r['freeze']}`" if r["freeze"] else "nothing"
        lines.append(
            f"| {what} | {', '.join(r['blocks'])} | {r['forward_only_stages']} | "
            f"{r['schedule']} / {r['partitioner']} | {r['samples_per_s']:.2f} |"
        )
    lines.append("")
    return "\n".join(lines)
