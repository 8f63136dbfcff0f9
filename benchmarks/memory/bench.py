"""Section `memory` of BENCHMARKS.md: each rank's peak memory against its plan, real-sized.

    python -m benchmarks --sections memory --out /tmp/memory.md

A Qwen2.5-0.5B-shaped model (494 M parameters; its tied 151,936 x 896 embedding is 545 MB in
fp32), random weights written in bf16 by `save_pretrained` as 5 safetensors shards, compiled
for 2 CPU ranks (even layers: the embedding on rank 0, the LM head reading it on rank 1) in
fp32 and in bf16 (16-bit weights and activations; fp32 masters, gradient sums and AdamW
state), trained for 4 steps with an evaluation after the 3rd: under FTPipe (the default
schedule) in bf16, PipeDream-2BW in fp32, and both again with every stage's optimizer
offloaded (`--offload-optimizer`; on a CPU rank the host's masters, state, sums and buffers
are the same memory: planned, the part `host` of `costs.gpu_memory`,
`costs.host.stage_host_bytes` of the rank's stages).
Planned: the plan's simulated peak under that schedule (what `ftpipe compile` and `ftpipe
simulate` report: `ftpipe_compiler.costs.gpu_memory` with the simulation's micro-batches in
flight and the offloaded stages whose next gradients it saw meet their CPU step, a second
sum; the plan alone counts that sum wherever the schedule can make it), by part (the
stages' weights, gradients, optimizer state and activations; the tied weight's copy and its
gradient on the reader; sends held; receive buffers posted ahead; a backward's largest
gradient; the device's reserve). Measured: the runtime's own report (`--log-json`'s
`memory_bytes`: the resident set grown since before the rank built its stages,
`ftpipe_runtime.job.memory.Memory`), with the whole resident set beside it. Target (issue 32):
every rank within 15% of its plan.

Sequences of 128 tokens, 2 micro-batches of 1 per step: the memory is the weights' (16 bytes a
parameter with AdamW), and 2 CPU cores train 0.5 B parameters at seconds per sequence. The
runs need about 2 x 8 GB: a machine with less free memory than NEED_GB is refused up front.
"""

from __future__ import annotations

import json
import os
from dataclasses import replace
from functools import partial
from pathlib import Path

from benchmarks.harness.launch import ROOT, compile_plan, run_package
from benchmarks.harness.set_up import prepare, take, timed_only
from ftpipe_compiler.costs.gpu_memory import gpu_memory
from ftpipe_compiler.costs.host import Offload
from ftpipe_compiler.plan import Plan
from ftpipe_compiler.simulate import simulate

WORK = ROOT / "out" / "bench" / "memory"

SHAPE = {  # Qwen/Qwen2.5-0.5B's config.json, less its weights
    "vocab_size": 151_936,
    "hidden_size": 896,
    "intermediate_size": 4_864,
    "num_hidden_layers": 24,
    "num_attention_heads": 14,
    "num_key_value_heads": 2,
    "max_position_embeddings": 32_768,
    "rope_theta": 1_000_000.0,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": True,
}
SHARD = "200MB"  # 988 MB of bf16 weights: 5 shards
# (schedule, precision, the run's options): FTPipe in bf16, what a GPU user trains in; the
# last keeps every stage's masters and AdamW state in host memory, the CPU step beside the
# stage's actions on the older version (2BW), which on a CPU rank is the same memory:
# planned, the GPU's part and the host's. (GPipe, a flush: tests/runtime/job/test_memory_plan.py,
# and here until 2026-11-29. Run with this
# file's CASES set to gpipe, 1f1b and zb1p in fp32 on 2026-11-29: 0.961 / 0.966, 0.962 / 0.981,
# 1.049 / 0.923; gpipe and 1f1b in fp32 with --offload-optimizer on 2026-11-30: 0.954 / 0.955,
# 0.955 / 0.971, where the plan before, counting a second gradient sum on the host that only
# an asynchronous schedule fills, made them 0.84 / 0.86 and 0.84 / 0.87. FTPipe in fp32, the
# first case until 2026-11-30: 0.959 / 0.882; in bf16 on 2026-11-30 beside gpipe-offload and
# 2bw in bf16: 0.961 / 0.916, 0.961 / 0.969, 0.998 / 0.977, the plans without an fp32 copy of
# the largest gradient since `precision.add_into`. A T5-large shape (738 M parameters, tied
# embedding, 128 source and 32 target tokens, even layers: the encoder on rank 0) on
# 2026-11-30 (`python -m benchmarks.memory.t5_large [DTYPE SCHEDULES]`): FTPipe and GPipe in bf16
# 0.944 / 0.926 and 0.944 / 0.967, FTPipe in fp32 0.951 / 0.916, 2BW in fp32 1.070 / 1.088
# then, 0.948 / 0.922 once 2BW held two weight copies, not three, and a backward on a
# set-aside version handed each gradient on as it was made: 7.44 / 8.37 GiB from 9.79 / 9.87.)
# FTPipe in bf16 with every stage's optimizer offloaded since 2026-11-30 (a minute): its plan
# counted a second gradient sum on the host that FTPipe never makes (`costs.host.sums_apart`),
# and measured 0.831 / 0.813 of it (fp32: 0.847 / 0.817), 0.960 / 0.920 without it.
OFFLOAD = ("--offload-optimizer",)
CASES = (("ftpipe", "bf16", ()), ("2bw", "fp32", ()), ("2bw", "fp32", OFFLOAD),
         ("ftpipe", "bf16", OFFLOAD))  # fmt: skip
PRECISIONS = tuple(dict.fromkeys(d for _, d, _ in CASES))  # a package compiled for each
# 2bw's peak is step 4's (its second weight version beside the state the evaluation left)
GPUS, STEPS, EVERY = 2, 4, 3
SEQ, MICRO_BATCHES, EVAL_SAMPLES = 128, 2, 4
TARGET = 0.15
NEED_GB = 17
TIMEOUT_S = 3600  # a run: loading 0.5 B parameters and 4 steps on 2 cores


def set_up(work: Path, shape: dict = SHAPE, shard: str = SHARD) -> dict:
    """The model written, its package compiled in each precision of `CASES` (analytic costs:
    nothing timed), the evaluation set: paths."""
    folder = _write_model(work / "model", shape, shard)
    made = {"model": str(folder), "val": str(_eval_set(work / "val.pt", shape["vocab_size"]))}
    for dtype in PRECISIONS:
        info = compile_plan(work / f"pkg-{dtype}", str(folder), GPUS, hardware="cpu",
                            schedule="gpipe", partitioners="even-layers", task="wikitext2",
                            seq_len=SEQ, micro_batch=1, batch=MICRO_BATCHES, dtype=dtype)  # fmt: skip
        made[dtype] = {"output": info["output"], "package": info["package"]}
    return made


def measure(work: Path | None = None, shape: dict = SHAPE, shard: str = SHARD) -> dict:
    work = Path(work or WORK)
    if shape is SHAPE:
        _check_free_memory()
    made = take(work, partial(set_up, shape=shape, shard=shard))
    folder, val = Path(made["model"]), made["val"]
    plans = {d: Plan.load(Path(made[d]["output"]) / "plan.json") for d in PRECISIONS}
    rows, losses, offloaded = [], {}, []
    for schedule, dtype, extra in CASES:
        package, plan = Path(made[dtype]["package"]), plans[dtype]
        name = schedule + "-offload" * bool(extra)
        argv = ["--steps", str(STEPS), "--schedule", schedule, "--eval-data", str(val)]
        argv += ["--eval-every", str(EVERY), "--checkpoint-dir", str(work / "ckpt" / name)]
        result = work / f"{name}.json"
        summary = run_package(package.parent, package.name, [*argv, *extra], result,
                              timeout=TIMEOUT_S)  # fmt: skip
        losses[name] = summary["losses"]
        planned = replace(plan, schedule=schedule)
        if extra:
            planned = planned.with_(stages=tuple(
                replace(s, offload=Offload(optimizer=True)) for s in planned.stages
            ))  # fmt: skip
            offloaded.append({  # where the ranks' offloaded steps spent their time (`PHASES`)
                "same_losses_as": schedule,
                "same_losses": summary["losses"] == losses.get(schedule),
                "per_step_s": [
                    {k: v / STEPS for k, v in (seconds or {}).items()}
                    for seconds in summary.get("offload_seconds") or []
                ],
            })  # fmt: skip
        # The simulated peak (what `ftpipe compile` and `ftpipe simulate` report): the plan's
        # memory with the simulation's micro-batches in flight and second gradient sums.
        sim = simulate(planned, schedule)
        in_flight = {s.id: n for s, n in zip(planned.stages, sim.in_flight, strict=True)}
        for rank in range(GPUS):
            # the runtime's default --post-ahead; on a CPU rank with what it offloads (`host`)
            parts = gpu_memory(planned, rank, in_flight, apart=frozenset(sim.sums_apart))
            assert parts.total == sim.gpus[rank].peak_memory_bytes  # (no split backward here)
            rows.append(
                {
                    "schedule": name,
                    "dtype": dtype,
                    "rank": rank,
                    "planned_bytes": parts.total,
                    "parts": parts.to_json(),
                    "measured_bytes": summary["memory_bytes"][rank],
                    "resident_bytes": summary["memory_reserved_bytes"][rank],
                    "evals": [e["step"] for e in summary["evals"]],
                }
            )
    for r in rows:
        r["ratio"] = r["measured_bytes"] / r["planned_bytes"]
    return {
        "model": "Qwen2.5-0.5B shape, random weights",
        "parameters": _parameters(folder),
        "shards": len(list(folder.glob("*.safetensors"))),
        "gpus": GPUS,
        "steps": STEPS,
        "eval_every": EVERY,
        "seq_len": SEQ,
        "micro_batches": MICRO_BATCHES,
        "target": TARGET,
        "planned": "simulated",
        "rows": rows,
        "met": all(abs(r["ratio"] - 1) <= TARGET for r in rows),
        "offloaded": offloaded,
    }


# (run, alone): the set-up beside other compute-only parts, the runs with the machine's
# memory to themselves
PARTS = {"set-up": (partial(prepare, WORK, set_up), False), "": (measure, True)}
combine = timed_only


def _check_free_memory() -> None:
    """Refuse to start two 8 GB ranks on a machine without the memory (they would be killed
    half-way, or take another process's memory)."""
    try:
        with open("/proc/meminfo") as f:
            free = {k: int(v.split()[0]) for k, v in (line.split(":", 1) for line in f)}
    except OSError:
        return
    gb = free.get("MemAvailable", 0) / 2**20
    if gb < NEED_GB:
        raise RuntimeError(
            f"the memory section needs about {NEED_GB} GB free, {gb:.1f} GB is: run it when "
            "the machine is quieter"
        )


def _write_model(folder: Path, shape: dict, shard: str) -> Path:
    """The model's folder, random weights in bf16 sharded by `save_pretrained` (kept when
    there: the same seed writes the same weights)."""
    if (folder / "config.json").exists():
        return folder
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(**shape)).to(torch.bfloat16)
    model.save_pretrained(folder, max_shard_size=shard)
    return folder


def _eval_set(path: Path, vocab: int) -> Path:
    import torch

    ids = torch.randint(0, vocab, (EVAL_SAMPLES, SEQ), generator=torch.Generator().manual_seed(1))
    torch.save({"input_ids": ids, "labels": ids}, path)
    return path


def _parameters(folder: Path) -> int:
    """Parameters in the folder's shards (the tied embedding once)."""
    index = folder / "model.safetensors.index.json"
    if index.exists():
        total = json.loads(index.read_text()).get("metadata", {}).get("total_size")
        if total:
            return int(total) // 2  # bf16
    return sum(os.path.getsize(p) for p in folder.glob("*.safetensors")) // 2


PLANNED = {  # what the planned figure is (the static one before 2026-11-30)
    None: "the compiler's memory model for that rank and schedule (`costs.gpu_memory`)",
    "simulated": "the plan's simulated peak for that rank and schedule, what `ftpipe "
    "simulate` reports (`costs.gpu_memory` with the simulation's micro-batches in flight, and "
    "a second gradient sum where it saw an offloaded stage's next backward meet its CPU step; "
    "the plan alone counts one wherever the schedule can make it)",
}


def markdown(data: dict) -> str:
    gib = 2**30
    lines = [
        "## Memory: each rank's peak against its plan",
        "",
        f"A {data['model']} ({data['parameters'] / 1e6:,.0f} M parameters, {data['shards']} "
        f"bf16 safetensors shards, a tied embedding), trained in each row's precision on "
        f"{data['gpus']} CPU ranks (bf16: 16-bit weights and activations, fp32 masters, "
        f"gradient sums and AdamW state) for {data['steps']} steps of {data['micro_batches']} micro-batches of 1 x "
        f"{data['seq_len']} tokens, with an evaluation every {data['eval_every']}. Planned: "
        f"{PLANNED.get(data.get('planned'), PLANNED[None])}; measured: the "
        "runtime's own report (the resident set grown since before the rank built its stages), "
        f"and the whole resident set. Target: within {data['target']:.0%} of the plan.",
        "",
        "| schedule | precision | rank | planned GiB | measured GiB | measured / planned | "
        "resident GiB | largest parts planned (GiB) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in data["rows"]:
        parts = {k: v for k, v in r["parts"].items() if k != "total" and v}
        top = sorted(parts.items(), key=lambda kv: -kv[1])[:4]
        said = ", ".join(f"{k.replace('_', ' ')} {v / gib:.2f}" for k, v in top)
        lines.append(
            f"| {r['schedule']} | {r.get('dtype', 'fp32')} | {r['rank']} | "
            f"{r['planned_bytes'] / gib:.2f} | "
            f"{r['measured_bytes'] / gib:.2f} | {r['ratio']:.3f} | "
            f"{r['resident_bytes'] / gib:.2f} | {said} |"
        )
    verdict = "met on every rank" if data["met"] else "NOT met"
    lines += ["", f"Target {verdict}.", ""]
    offloaded = data.get("offloaded") or []  # one case's dict before 2026-11-30
    for off in [offloaded] if isinstance(offloaded, dict) else offloaded:
        ranks = "; ".join(
            f"rank {r}: the CPU step {s['cpu_step']:.2f} s a step on the step thread, the rank "
            f"waited {s['step_wait']:.2f} s for it "
            f"({max(0.0, 1 - s['step_wait'] / s['cpu_step']):.0%} overlapped)"
            for r, s in enumerate(off["per_step_s"])
            if s.get("cpu_step")
        )
        same = "the same bit for bit" if off["same_losses"] else "DIFFERENT"
        lines += [
            f"With the optimizer offloaded ({off['same_losses_as']}-offload): losses {same} as "
            f"{off['same_losses_as']}'s without; {ranks}.",
            "",
        ]
    return "\n".join(lines)
