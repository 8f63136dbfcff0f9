"""Section `freeze`: PipeTransformer's freeze training on elastic pipelines, simulated and small.

    python -m benchmarks --sections freeze --out /tmp/freeze.md

The paper's SQuAD run (He et al., ICML'21, §4.1-4.2, Table 1 and Table 3): BERT-large
(24 layers) fine-tuned on SQuAD v1.1 for 3 epochs, batch 64 per pipeline, sequences of
512, on 2 machines x 8 Quadro RTX 5000 (PCIe 3.0 inside, InfiniBand 5 GB/s between),
alpha = 1/3; baseline PyTorch Pipe (GPipe) + DDP, 8-GPU pipelines. Reported: 5 h 7 min
without freezing, 2 h 26 min with PipeTransformer, 2.10x. Here `planner.elastic` plans
every interval (graph with the frozen prefix, pipelines of 8, 4, 2, 1 GPUs with the freed
GPUs as replicas, AutoCache where the simulator says it pays) and sums the intervals'
simulated time. Freeze decisions are taken once per epoch (the released code's freeze
interval) with the rule's bound limiting (the most freezing alpha allows); other alphas and
a finer decision interval show how the figure moves. Samples per epoch: SQuAD v1.1's
87,599 training questions.

`measure_switch` runs the real thing small: the zoo's tiny BERT with 4 layers, compiled with
`--freeze-training`, on 4 CPU ranks (gloo), 2 layers frozen after step RUN_SWITCH (forced),
the run switching from 1 pipeline x 4 GPUs to 2 replicas x 2 GPUs, against the same run on
the 4-GPU plan alone (`--no-shrink`). Each segment's rate is taken over its steps after the
first WARM (set-up and the first step overlap them), from the step ends in the runtime's
summary.
"""

from __future__ import annotations

import json
import shutil
import time
from functools import partial
from pathlib import Path

from benchmarks.harness.launch import ROOT, compile_plan, run_package
from benchmarks.harness.set_up import prepare, take
from ftpipe_compiler.costs.cluster import get_cluster
from ftpipe_compiler.costs.profilers import costed_graph
from ftpipe_compiler.planner.elastic import FreezeRun, simulate_freezing
from ftpipe_compiler.resources import load_config

MODEL, TASK, HARDWARE, GPUS = "bert-large", "squad", "quadro-rtx5000", 16
SEQ_LEN, MICRO_BATCH, BATCH, EPOCHS, SAMPLES = 512, 4, 64, 3, 87_599
PAPER = {"speedup": 2.10, "baseline_h": 5 + 7 / 60, "pipetransformer_h": 2 + 26 / 60}
CHAIN = ("pipedream",)  # one contiguous cut per pipeline GPU, as AutoPipe's partition
# (alpha, decisions per epoch, partitioners, label)
CASES = [
    (1 / 3, 1, CHAIN, "paper's alpha, chain partition"),
    (1 / 3, 1, None, "paper's alpha, every ftpipe partitioner"),
    (1 / 5, 1, CHAIN, "alpha 1/5 (Fig. 10a)"),
    (1 / 2, 1, CHAIN, "alpha 1/2 (aggressive)"),
    (1 / 3, 4, CHAIN, "paper's alpha, 4 decisions per epoch"),
]
WORK = ROOT / "out" / "bench" / "freeze"  # the real switch's model, package and runs
# The real switch, small: (steps, switch after, warm-up steps left out of each rate)
RUN_STEPS, RUN_SWITCH, WARM, RUN_BATCH = 40, 20, 3, 8
RUN_LAYERS = 4  # one per rank of the 4-GPU plan (the zoo's bert-tiny has 2)


def measure() -> dict:
    return {**simulated(), "switch": measure_switch()}


def _rates(summary: dict) -> list[dict]:
    """Samples/s before and after the freeze, each over its steps after the first WARM, from
    the step ends (seconds since the segment's training started; a switch starts one)."""
    ends, out = summary["step_ends_s"], []
    for first, end in ((0, RUN_SWITCH), (RUN_SWITCH, RUN_STEPS)):
        seg = next(g for g in summary["segments"] if g["steps"][0] <= first < g["steps"][1])
        times = ends[first + WARM - 1 : end]
        out.append({"steps": [first, end], "replicas": seg["replicas"], "gpus": seg["gpus"],
                    "samples_per_s": (len(times) - 1) * RUN_BATCH / (times[-1] - times[0])})  # fmt: skip
    return out


def switch_package(work: Path) -> dict:
    """The tiny BERT written and compiled (analytic costs: nothing timed) for 4 GPUs with
    its shorter plans: the output folder and the package's name."""
    import torch
    import transformers

    for old in ("bert", "out"):
        shutil.rmtree(work / old, ignore_errors=True)
    tiny = load_config("models", "bert-tiny")["config"]  # dropout off
    config = transformers.BertConfig(**{**tiny, "num_hidden_layers": RUN_LAYERS})
    torch.manual_seed(0)
    transformers.BertForQuestionAnswering(config).save_pretrained(work / "bert")
    compiled = compile_plan(work / "out", str(work / "bert"), 4, seq_len=16, micro_batch=2,
                            batch=RUN_BATCH, schedule="gpipe", partitioners="even-layers", freeze_training=0.5)  # fmt: skip
    return {"output": compiled["output"], "package": Path(compiled["package"]).name}


def measure_switch(work: Path | None = None) -> dict:
    work = Path(work or WORK)
    made = take(work, switch_package)
    out, package = Path(made["output"]), made["package"]
    argv = ["--steps", str(RUN_STEPS), "--freeze-at", f"{RUN_SWITCH}:2", "--optimizer", "sgd"]
    elastic = out / package / "elastic"
    switching = run_package(out, package, argv, work / "switch.json", gpus=4)
    staying = run_package(out, package, [*argv, "--no-shrink"], work / "stay.json", gpus=4)
    rows = []
    for name, summary in (("switching", switching), ("4 GPUs throughout", staying)):
        rows += [{"run": name, **r} for r in _rates(summary)]
    return {"steps": RUN_STEPS, "switch_after": RUN_SWITCH, "warm": WARM, "rows": rows,
            "plans": json.loads((elastic / "index.json").read_text())["plans"]}  # fmt: skip


def simulated() -> dict:
    t0 = time.perf_counter()
    graph = costed_graph(MODEL, TASK, HARDWARE, MICRO_BATCH, SEQ_LEN)[3]
    trace_s = time.perf_counter() - t0
    cluster = get_cluster(HARDWARE, GPUS)
    rows = []
    for alpha, per_epoch, parts, label in CASES:
        t = time.perf_counter()
        run = FreezeRun(alpha=alpha, epochs=EPOCHS, samples=SAMPLES, batch=BATCH, depth=8,
                        decisions_per_epoch=per_epoch, partitioners=parts)  # fmt: skip
        got = simulate_freezing(graph, cluster, run)
        rows.append({"label": label, **got.to_json(), "plan_seconds": time.perf_counter() - t})
    return {
        "model": MODEL,
        "task": TASK,
        "hardware": HARDWARE,
        "gpus": GPUS,
        "nodes": cluster.nodes,
        "seq_len": SEQ_LEN,
        "micro_batch": MICRO_BATCH,
        "trace_seconds": trace_s,
        "paper": PAPER,
        "cases": rows,
    }


def _shapes(case: dict) -> str:
    out = []
    for i in case["intervals"]:
        s = i["shape"]
        cache = ""
        if i["cache_read"] or i["cache_write"]:
            cache = f" (cache: read {i['cache_read'] or '-'}, write {i['cache_write'] or '-'})"
        out.append(f"{i['frozen']}: {s['replicas']}x{s['depth']}{cache}")
    return "; ".join(out)


def markdown(data: dict) -> str:
    p = data["paper"]
    lines = [
        "## Freeze training: PipeTransformer on elastic pipelines (simulated)",
        "",
        f"{data['model']} on {data['task']} (sequences of {data['seq_len']}, micro-batches of "
        f"{data['micro_batch']}, batch {BATCH} per pipeline, {EPOCHS} epochs of {SAMPLES:,} "
        f"samples, Adam, fp32, GPipe) on {data['gpus']} x {data['hardware']} in "
        f"{data['nodes']} nodes: the paper's setup (§4.1, Table 3). Each interval between "
        "freeze decisions is planned with its frozen prefix on pipelines of 8, 4, 2, 1 GPUs, "
        "freed GPUs as replicas (`planner.elastic`); AutoCache where it pays (64 GiB host "
        "memory per node for the cache, the rest on a 2 GB/s disk per node). The first "
        "interval runs the paper's baseline shape (2 x 8). Frozen counts follow eq. 1's "
        "bound (the gradient term never smaller: the most freezing alpha allows). Paper "
        f"(Table 1, SQuAD, alpha 1/3): {p['baseline_h']:.2f} h -> {p['pipetransformer_h']:.2f} h, "
        f"**{p['speedup']:.2f}x**.",
        "",
        "| case | frozen: replicas x depth per interval | no freeze, 2 x 8 (h) | best static "
        "shape (h) | freezing, no cache (h) | freezing + AutoCache (h) | speedup vs 2 x 8 | "
        "vs best static | paper | planning s |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for c in data["cases"]:
        b = c["best_no_freeze"]
        lines.append(
            f"| {c['label']} | {_shapes(c)} | {c['baseline_seconds'] / 3600:.2f} | "
            f"{c['best_no_freeze_seconds'] / 3600:.2f} ({b['replicas']}x{b['depth']}) | "
            f"{c['no_cache_seconds'] / 3600:.2f} | {c['seconds'] / 3600:.2f} | "
            f"{c['speedup']:.2f}x | {c['speedup_vs_best']:.2f}x | {p['speedup']:.2f}x | "
            f"{c['plan_seconds']:.1f} |"
        )
    lines += [
        "",
        f"Traced once in {data['trace_seconds']:.1f} s. The simulated baseline is "
        f"{data['cases'][0]['baseline_seconds'] / 3600:.2f} h against the paper's measured "
        f"{p['baseline_h']:.2f} h: the roofline at 50% of peak is not a calibrated RTX 5000.",
        "",
    ]
    if "switch" in data:
        lines += _switch_markdown(data["switch"])
    return "\n".join(lines)


def _switch_markdown(sw: dict) -> list[str]:
    lines = [
        f"Measured, small: a 4-layer BERT compiled with `--freeze-training 0.5` on 4 CPU ranks, "
        f"{sw['steps']} steps of 8 samples, 2 layers frozen after step {sw['switch_after']} "
        "(forced); the switching run moves to 2 replicas x 2 GPUs, the other stays on its "
        f"4-GPU pipeline (freezing alike). Samples/s before and after the freeze, the first "
        f"{sw['warm']} steps of each left out:",
        "",
        "| run | steps | replicas x GPUs | samples/s |",
        "|---|---|---|---:|",
    ]
    for r in sw["rows"]:
        a, b = r["steps"]
        lines.append(
            f"| {r['run']} | {a + 1}-{b} | {r['replicas']} x {r['gpus']} | "
            f"{r['samples_per_s']:.1f} |"
        )
    return lines + [""]


PARTS = {  # (run, alone)
    "simulated": (simulated, False),
    "switch-compile": (partial(prepare, WORK, switch_package), False),
    "switch": (measure_switch, True),
}


def combine(parts: dict) -> dict:
    return {**parts["simulated"], "switch": parts["switch"]}
