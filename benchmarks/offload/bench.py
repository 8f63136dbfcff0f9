"""Section `offload` of BENCHMARKS.md: host offload chosen per stage by the planner (simulated),
and the offload path's cost on this machine (measured).

    python -m benchmarks --sections offload --out /tmp/offload.md    # this section alone

1. Plans. Meta-device models built from their configs (nothing downloaded), analytic costs at
   layer granularity, their task's shapes, planned as `ftpipe compile --offload auto` plans
   them (`planner.offload.searches`: without offload first, with it only when nothing fits)
   among `SCHEDULES` x the quick partitioners, simulated: Llama-3.1-8B full fine-tuning in
   bf16 with fp32 masters on 4 x rtx4090, against bf16-pure and LoRA r=16 (q_proj, v_proj)
   on the same GPUs; a Qwen2.5-14B-shaped full fine-tuning on 8 x rtx4090; T5-11B on 4 x
   rtx4090 (bf16 with fp32 masters); the mixture of experts Qwen1.5-MoE-A2.7B (14.3 B
   parameters) on 4 x rtx4090, full fine-tuning in bf16 with fp32 masters. For each: the
   fastest plan that fits, what each stage offloads, every GPU's peak memory, each node's
   host memory, host traffic per step, the CPU step and the share of it the schedule hides
   (`simulate.host.cpu_step_hidden`). The host figures are the hardware file's
   (rtx4090.json's `host`: an assumed 8-GPU PCIe 4.0 server, its sources there). bf16-pure
   traces the same program as bf16 (both compute in bf16): its graph is the bf16 one with
   its precision set, not a second trace.
2. Overhead. GPT-2 bench (19.4 M parameters, `SEQ`-token sequences) in 2 stages on 2 CPU
   ranks under 1F1B, trained `STEPS` steps by its generated package as compiled (--offload
   none) and by the same package with every stage's `offload.optimizer` set in its plan.json
   (the runtime's per-stage path: masters and AdamW state in separate host tensors, every
   gradient copied and summed there, the step on them), `ROUNDS` alternating rounds; the
   median step after `WARMUP`, the CPU other processes used meanwhile, and whether the
   losses are the same bit for bit. On a CPU the "device" is the host, so this is the
   bookkeeping's cost (copies, sums), not a PCIe link's.
"""

from __future__ import annotations

import json
import shutil
import statistics
import time
from dataclasses import replace
from functools import partial
from pathlib import Path

from benchmarks.harness.launch import ROOT, compile_plan, run_package
from benchmarks.harness.set_up import prepare, take
from benchmarks.harness.stats import run_rounds, step_times, summarise_steps
from ftpipe_compiler.costs.profilers import costed_graph
from ftpipe_compiler.partition import problem_from_graph
from ftpipe_compiler.planner.matrix import CHEAP, NothingFits, search_matrix
from ftpipe_compiler.planner.nofit import floor_fits
from ftpipe_compiler.planner.offload import searches
from ftpipe_compiler.simulate.simulator import cpu_step_hidden

GIB = 2**30
SCHEDULES = ["gpipe", "1f1b", "zb1p", "ftpipe"]
STEPS_SIMULATED = 10
LORA = "r=16,alpha=32,targets=q_proj,v_proj"
FULL = "full fine-tuning, bf16 (fp32 masters)"
CASES = {  # part -> (model, hardware, GPUs, rows: (label, --dtype, --lora))
    "llama": ("llama-3.1-8b", "rtx4090", 4, [(FULL, "bf16", None),
                                              ("full fine-tuning, bf16-pure", "bf16-pure", None),
                                              ("LoRA r=16 q_proj,v_proj, bf16 base", "bf16", LORA)]),
    "qwen": ("qwen2.5-14b", "rtx4090", 8, [(FULL, "bf16", None)]),
    "t5": ("t5-11b", "rtx4090", 4, [(f"{FULL}, Adafactor (its task's)", "bf16", None)]),
    "moe": ("qwen1.5-moe-a2.7b", "rtx4090", 4, [(FULL, "bf16", None)]),
}  # fmt: skip
MODEL, SEQ, STEPS, WARMUP, ROUNDS = "gpt2-bench", 32, 5, 2, 2
WORK = ROOT / "out" / "bench" / "offload"


def _graph(model: str, hardware: str, dtype: str, lora, traced: dict):
    """The costed graph; bf16-pure's is bf16's with its precision set (the same program)."""
    if dtype == "bf16-pure" and (model, "bf16", lora) in traced:
        g = traced[(model, "bf16", lora)]
        return replace(g, meta={**g.meta, "precision": dtype})
    *_, g = costed_graph(model, hardware=hardware, precision=dtype,
                                 granularity="layer", lora=lora)  # fmt: skip
    traced[(model, dtype, lora)] = g
    return g


def plan_row(graph, hardware: str, gpus: int) -> dict:
    """The fastest plan that fits, searched as `compile --offload auto` searches."""
    base = problem_from_graph(graph, gpus, hardware, "1f1b")
    floor = sum(base.static_bytes.values()) / gpus
    row = {"trainable_params": graph.num_parameters, "static_floor_bytes_per_gpu": floor,
           "memory_bytes": base.capacity}  # fmt: skip
    for mode in searches("auto", base.hardware.host):
        problem = replace(base, offload=mode)
        if not floor_fits(problem):
            continue
        try:
            best, _ = search_matrix(problem, SCHEDULES, list(CHEAP), steps=STEPS_SIMULATED,
                                    workers=1)  # fmt: skip
        except NothingFits:
            continue
        row = {**row, "feasible": True, **_figures(best.plan, best.sim)}
        if any(s.offload.optimizer for s in best.plan.stages):  # as --offload-step lagged
            lagged = replace(problem, offload_step="lagged")
            best, _ = search_matrix(lagged, SCHEDULES, list(CHEAP), steps=STEPS_SIMULATED,
                                    workers=1)  # fmt: skip
            row["lagged"] = {k: v for k, v in _figures(best.plan, best.sim).items()
                             if k in ("schedule", "partitioner", "samples_per_s", "step_time_s",
                                      "cpu_step_hidden")}  # fmt: skip
        return row
    return {**row, "feasible": False}


def _figures(plan, sim) -> dict:
    hidden = cpu_step_hidden(plan, sim)
    return {
        "schedule": sim.schedule,
        "partitioner": plan.partitioner,
        "samples_per_s": sim.samples_per_s,
        "step_time_s": sim.step_time_s,
        "offload": [_what(s.offload) for s in plan.stages],
        "stage_gpus": [s.gpu for s in plan.stages],
        "gpu_memory_bytes": [g.peak_memory_bytes for g in sim.gpus],
        "host_memory_bytes": [n.host_bytes for n in sim.nodes],
        "host_capacity_bytes": plan.host.memory_bytes,
        "host_bytes_down_per_step": sum(g.host_bytes_down for g in sim.gpus),
        "host_bytes_up_per_step": sum(g.host_bytes_up for g in sim.gpus),
        "cpu_step_s": max((g.cpu_step_s for g in sim.gpus), default=0.0),
        "cpu_step_hidden": hidden,
    }


def _what(off) -> str:
    """'optimizer', 'optimizer (GPU sums)', 'activations', 'optimizer+activations' or '-'."""
    parts = [k for k in ("optimizer", "activations") if getattr(off, k)]
    if off.sums_on_device:
        parts[0] += " (GPU sums)"
    return "+".join(parts) or "-"


def plan_case(part: str) -> dict:
    model, hardware, gpus, rows = CASES[part]
    traced, out = {}, []
    for label, dtype, lora in rows:
        t0 = time.perf_counter()
        graph = _graph(model, hardware, dtype, lora, traced)
        row = plan_row(graph, hardware, gpus)
        out.append({"label": label, "dtype": dtype, "lora": lora, **row,
                    "seconds": time.perf_counter() - t0})  # fmt: skip
    task = next(iter(traced.values())).meta.get("task", "")
    return {"model": model, "hardware": hardware, "gpus": gpus, "task": task, "rows": out}


def compile_both(work: Path) -> dict:
    """The plan compiled (analytic costs: nothing timed) into plain/, and a copy with every
    stage's optimizer offloaded into offloaded/: the package's name."""
    for old in ("plain", "offloaded"):
        shutil.rmtree(work / old, ignore_errors=True)
    info = compile_plan(work / "plain", MODEL, 2, hardware="cpu", schedule="1f1b",
                        partitioners="even-layers", offload="none", seq_len=SEQ)  # fmt: skip
    package = Path(info["package"]).name
    shutil.copytree(work / "plain", work / "offloaded")
    plan_file = work / "offloaded" / package / "plan.json"
    plan = json.loads(plan_file.read_text())
    for s in plan["stages"]:
        s["offload"] = {"optimizer": True, "activations": False}
    plan_file.write_text(json.dumps(plan, indent=1))
    return {"package": package}


def overhead(work: Path | None = None, rounds: int = ROUNDS) -> dict:
    """The same plan trained with and without every stage's optimizer offloaded (2 CPU ranks),
    in alternating rounds (`run_rounds`: a disturbance from the shared machine spreads)."""
    work = Path(work or WORK)
    package = take(work, compile_both)["package"]
    plan = json.loads((work / "offloaded" / package / "plan.json").read_text())

    def run(name: str):
        def go(tag: str, _round: int) -> dict:
            summary = run_package(work / name, package, ["--steps", str(STEPS)],
                                  work / f"{tag}.json")  # fmt: skip
            return {"times": step_times(summary["step_ends_s"], WARMUP),
                    "losses": summary["losses"], "memory_bytes": summary["memory_bytes"]}  # fmt: skip

        return go

    raw = run_rounds({n: run(n) for n in ("plain", "offloaded")}, rounds, "offload overhead")
    runs = {
        name: {
            **summarise_steps([t for r in rs for t in r["times"]], 1),
            "median_step_s": statistics.median(t for r in rs for t in r["times"]),
            "losses": rs[0]["losses"],
            "memory_bytes": rs[0]["memory_bytes"],
            "other_cores": [r["other_cores"] for r in rs],
        }  # fmt: skip
        for name, rs in raw.items()
    }
    plain, off = runs["plain"], runs["offloaded"]
    return {
        "model": MODEL,
        "seq_len": SEQ,
        "stages": len(plan["stages"]),
        "runs": runs,
        "overhead": off["median_step_s"] / plain["median_step_s"] - 1,
        "same_losses": all(
            r["losses"] == raw["plain"][0]["losses"] for rs in raw.values() for r in rs
        ),  # fmt: skip
    }


PARTS = {part: (partial(plan_case, part), False) for part in CASES}
PARTS["overhead-compile"] = (partial(prepare, WORK, compile_both), False)
PARTS["overhead"] = (overhead, True)  # (run, alone): it times 2 ranks on the 2 cores


def combine(parts: dict) -> dict:
    return {"plans": [parts[p] for p in CASES if p in parts], "overhead": parts.get("overhead")}


def measure() -> dict:
    return combine({name: run() for name, (run, _) in PARTS.items()})


def _gib(b) -> str:
    return f"{b / GIB:.1f}"


def _choices(row: dict) -> str:
    """'GPU 0: optimizer; GPU 1: optimizer...' or 'none' (per stage, with its GPU)."""
    if all(o == "-" for o in row["offload"]):
        return "none"
    return ", ".join(f"{s}@{g}: {o}" for s, (o, g) in enumerate(zip(row["offload"],
                                                                    row["stage_gpus"])))  # fmt: skip


def _lagged(row: dict) -> str:
    """The lagged search's samples/s and hidden share, its schedule where another: '-'
    where nothing offloads its optimizer."""
    lag = row.get("lagged")
    if not lag:
        return "-"
    hidden = lag["cpu_step_hidden"]
    share = f" ({hidden:.0%})" if hidden is not None else ""
    other = f", {lag['schedule']}" if lag["schedule"] != row["schedule"] else ""
    return f"{lag['samples_per_s']:.3f}{share}{other}"


def markdown(data: dict) -> str:
    lines = [
        "## Host offload (simulated plans; the offload path measured)",
        "",
        f"Plans as `ftpipe compile --offload auto` makes them (without offload first, with it "
        f"only when nothing fits), the fastest that fits among {', '.join(SCHEDULES)} x the "
        "quick partitioners, analytic costs at layer granularity, the task's shapes. Offload "
        "per stage as `stage@GPU: what`; host memory per node against the hardware file's "
        "(rtx4090: an assumed 8-GPU PCIe 4.0 server, 512 GiB); host traffic per step over all "
        "GPUs (down: gradients each micro-batch, or their fp32 sums once a step where a stage "
        "sums them on its GPU (`GPU sums`), and activations; up: weights each step and "
        "activations); the CPU step of the busiest GPU and the share of it the schedule hides. "
        "The CPU step runs beside the rank's next actions and lands where the stage's weights "
        "are next read (the update without offload); the last column is the same search with "
        "`--offload-step lagged`, whose steps land at the stage's next step under FTPipe's "
        "schedule (its actions read weights one step older), with the share it hides.",
        "",
        "| model, GPUs | training | fits | schedule / partitioner | samples/s | offload "
        "| GPU GiB (peak, each) | host GiB per node | host traffic GiB down / up | CPU step s "
        "(hidden) | lagged: samples/s (hidden) |",
        "|---|---|---|---|---:|---|---|---:|---:|---:|---:|",
    ]
    for case in data["plans"]:
        where = f"{case['model']} ({case['task']}), {case['gpus']} x {case['hardware']}"
        for r in case["rows"]:
            if not r["feasible"]:
                floor = _gib(r["static_floor_bytes_per_gpu"])
                lines.append(f"| {where} | {r['label']} | no (floor {floor} GiB per GPU) "
                             "| | | | | | | | |")  # fmt: skip
                continue
            hidden = r["cpu_step_hidden"]
            cpu = f"{r['cpu_step_s']:.2f} ({hidden:.0%})" if hidden is not None else "-"
            host = " / ".join(_gib(b) for b in r["host_memory_bytes"]) or "0"
            lines.append(
                f"| {where} | {r['label']} | yes | {r['schedule']} / {r['partitioner']} "
                f"| {r['samples_per_s']:.3f} | {_choices(r)} "
                f"| {' / '.join(_gib(b) for b in r['gpu_memory_bytes'])} "
                f"| {host} of {_gib(r['host_capacity_bytes'])} "
                f"| {_gib(r['host_bytes_down_per_step'])} / {_gib(r['host_bytes_up_per_step'])} "
                f"| {cpu} | {_lagged(r)} |"
            )
    lines += [
        "",
        "Where an offloaded step's time goes: a stage streaming its gradients copies every "
        "micro-batch's to the host and sums them there in fp32, so the host link and the CPUs "
        "see m x the weights per step, on the GPU's stream and the rank's thread; a stage with "
        "`GPU sums` (the planner's choice where that sends fewer bytes, m > 2 in bf16, and its "
        "GPU fits the fp32 sums) sums them on its GPU and copies the sum (4 B an element) "
        "down once, at its step (`ftpipe_runtime.train.offload`: either way the same "
        "additions as without offload). The CPU step runs on a thread of the rank beside "
        "what follows its S, but exactly it lands where the stage's weights are next read: "
        "under FTPipe and a flush that is the stage's next forward, so it is hidden only on a "
        "GPU with slack or behind the next step's forwards of earlier stages (PipeDream-2BW "
        "and WPipe run a step on the older version: a whole step overlaps). Lagged, FTPipe's "
        "stage runs on until its next S: the CPU step overlaps a whole step where it is "
        "shorter, a rule of its own (`train_stale(lag=1)` in the tests).",
    ]
    o = data.get("overhead")
    if o:
        p, f = o["runs"]["plain"], o["runs"]["offloaded"]
        busy = max(c or 0 for r in o["runs"].values() for c in r["other_cores"])
        lines += [
            "",
            f"The offload path on this machine: {o['model']} ({o['seq_len']}-token sequences) "
            f"in {o['stages']} stages on 2 CPU ranks, 1F1B, {ROUNDS} alternating rounds of "
            f"{STEPS} steps, the median of the steps after {WARMUP}: "
            f"{p['median_step_s'] * 1e3:.0f} ms per step as compiled (mean "
            f"{p['step_s'] * 1e3:.0f} ± {p['step_std_s'] * 1e3:.0f}), "
            f"{f['median_step_s'] * 1e3:.0f} ms with every stage's optimizer offloaded in its "
            f"plan (mean {f['step_s'] * 1e3:.0f} ± {f['step_std_s'] * 1e3:.0f}): "
            f"{o['overhead']:+.0%}, other processes using {busy:.1f} cores at most meanwhile"
            + (
                " (this machine was shared: the difference is within its noise)"
                if busy > 0.5
                else ""
            )
            + "; "  # fmt: skip
            f"losses {'the same bit for bit' if o['same_losses'] else 'DIFFERENT'}. Rank 0's "
            f"memory {p['memory_bytes'][0] / 2**20:.0f} and {f['memory_bytes'][0] / 2**20:.0f} "
            "MiB: on a CPU the host copies are the device's memory too.",
        ]
    return "\n".join(lines) + "\n"
