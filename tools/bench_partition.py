"""Partitioners compared on the paper's models, as Markdown tables (for BENCHMARKS.md).

    python tools/bench_partition.py                       # all four cases, 8 GPUs
    python tools/bench_partition.py --models t5-3b --out part.md

Analytic costs, each model's default task (T5: rte, 512/4 tokens, micro-batch 4; GPT-2:
wikitext2; BERT: squad), the task's optimizer and micro-batches per step, async (ftpipe)
schedule. Every partitioner is run; the period is compared with the lower bound.
"""

from __future__ import annotations

import argparse
import sys
import time

from ftpipe_compiler.partition import pick_best, problem_from_graph, run_partitioners
from ftpipe_compiler.profiling import costed_graph

CASES = {  # model -> hardware
    "t5-3b": "rtx2080ti",
    "t5-11b": "v100-32gb",
    "gpt2-xl": "rtx2080ti",
    "bert-large": "rtx2080ti",
}


def bench(model: str, hardware: str, gpus: int, schedule: str) -> str:
    spec, task, _, graph = costed_graph(model, hardware=hardware)
    problem = problem_from_graph(graph, gpus, hardware, schedule, None, None, 0)
    t0 = time.perf_counter()
    results = run_partitioners(problem)
    seconds = time.perf_counter() - t0
    best = pick_best(results).partitioner if any(r.feasible for r in results) else None
    lb = problem.lower_bound()
    lines = [
        f"### {spec.name} on {gpus} x {hardware}",
        "",
        f"{task.name}, micro-batch {graph.meta.get('micro_batch')}, {problem.micro_batches} micro-batches "
        f"per step, {problem.optimizer}, {schedule} schedule, {len(graph.nodes):,} nodes. Lower bound "
        f"{lb * 1e3:.1f} ms (speedup at most {gpus}). All partitioners together: {seconds:.1f} s.",
        "",
        "| partitioner | period (ms) | / lower bound | expected speedup | stages | max memory (GiB) "
        "| comm (MB) | search (s) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        name = f"**{r.partitioner}**" if r.partitioner == best else r.partitioner
        if not r.feasible:
            lines.append(f"| {name} | {r.error} | | | | | | {r.search_seconds:.2f} |")
            continue
        p = r.plan
        lines.append(
            f"| {name} | {p.period_s * 1e3:.1f} | {p.period_s / lb:.3f} | {p.expected_speedup:.2f} "
            f"| {len(p.stages)} | {p.max_memory_bytes / 2**30:.2f} | {p.comm_bytes / 1e6:.0f} "
            f"| {r.search_seconds:.2f} |"
        )
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--models", default=",".join(CASES), help="comma-separated subset of " + ", ".join(CASES)
    )
    ap.add_argument("--gpus", type=int, default=8)
    ap.add_argument("--schedule", default="ftpipe")
    ap.add_argument("--out", default=None, help="also write the Markdown here")
    args = ap.parse_args(argv)
    parts = ["## Partitioners (analytic costs)\n"]
    for model in [m.strip() for m in args.models.split(",") if m.strip()]:
        if model not in CASES:
            sys.exit(f"unknown model {model!r}; choose from {', '.join(CASES)}")
        parts.append(bench(model, CASES[model], args.gpus, args.schedule))
        print(parts[-1], flush=True)
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n".join(parts))


if __name__ == "__main__":
    main()
