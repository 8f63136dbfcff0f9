"""Section `plans`: every partitioner on the paper's models and hardware, simulated (analytic costs).

python -m benchmarks --sections plans --out /tmp/plans.md
"""

from __future__ import annotations

import sys
import time

from ftpipe_compiler.costs.profilers import costed_graph
from ftpipe_compiler.partition import problem_from_graph, run_partitioners
from ftpipe_compiler.simulate import simulate

ALONE = False  # it only computes: it may share the machine (benchmarks.sections)

SEQUENTIAL = ("pipedream", "acyclic", "even-layers", "params")
# (model, task, hardware, gpus): the paper's machine, and V100 boxes of 4 and 8.
PLAN_CASES = [
    ("t5-3b", "rte", "rtx2080ti", 8),
    ("t5-3b", "boolq", "rtx2080ti", 8),
    ("t5-3b", "rte", "v100-32gb", 4),
    ("t5-11b", "rte", "v100-32gb", 8),
    ("gpt2-xl", "wikitext2", "rtx2080ti", 8),
    ("gpt2-xl", "wikitext2", "v100-32gb", 4),
    ("bert-large", "squad", "rtx2080ti", 8),
    ("bert-large", "squad", "v100-32gb", 4),
]


def measure(cases=PLAN_CASES, schedule="ftpipe", steps=20) -> dict:
    out = []
    for model, task, hardware, gpus in cases:
        t0 = time.perf_counter()
        spec, t, _, graph = costed_graph(model, task, hardware)
        problem = problem_from_graph(graph, gpus, hardware, schedule, None, None, 0)
        results = run_partitioners(problem, progress=False)
        rows = []
        for r in results:
            row = r.to_json()
            if r.feasible:
                sim = simulate(r.plan, steps=steps)
                row.update(
                    simulated_step_time_s=sim.step_time_s,
                    samples_per_s=sim.samples_per_s,
                    bubble_fraction=sim.bubble_fraction,
                    fits=sim.fits,
                )
            rows.append(row)
        out.append(
            {
                "model": model,
                "task": t.name,
                "hardware": hardware,
                "gpus": gpus,
                "schedule": schedule,
                "micro_batch": graph.meta["micro_batch"],
                "micro_batches": problem.micro_batches,
                "optimizer": problem.optimizer,
                "nodes": len(graph.nodes),
                "lower_bound_s": problem.lower_bound(),
                "results": rows,
                "seconds": time.perf_counter() - t0,
            }
        )
        print(
            f"  plans: {model} {task} {gpus} x {hardware}: {out[-1]['seconds']:.0f} s",
            file=sys.stderr,
        )
    return {"cases": out}


def markdown(data: dict) -> str:
    lines = [
        "## 1. Plan quality (analytic costs, simulated)",
        "",
        "Every partitioner on the same costed graph, memory model and simulator. *period* is "
        "FTPipe eq. 1 (the slowest GPU's compute plus unhidden transfers, per micro-batch); "
        "*expected speedup* = total compute / period; throughput is the simulator's steady "
        "state under the asynchronous `ftpipe` schedule. Mixed vs best sequential compares "
        "simulated samples/s with the best of pipedream, acyclic, even-layers and params.",
        "",
    ]
    for c in data["cases"]:
        ok = [r for r in c["results"] if r["feasible"] and r.get("fits", True)]
        best = max(ok, key=lambda r: r["samples_per_s"], default=None)
        seq = [r for r in ok if r["partitioner"] in SEQUENTIAL]
        mixed = next((r for r in ok if r["partitioner"] == "mixed"), None)
        lines += [
            f"### {c['model']} ({c['task']}, micro-batch {c['micro_batch']} x {c['micro_batches']}, "
            f"{c['optimizer']}) on {c['gpus']} x {c['hardware']}",
            "",
            f"{c['nodes']:,} nodes; lower bound {c['lower_bound_s'] * 1e3:.1f} ms per micro-batch.",
            "",
            "| partitioner | samples/s (sim) | period ms | / lower bound | expected speedup | stages "
            "| max memory GiB | comm MB | search s |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for r in c["results"]:
            name = f"**{r['partitioner']}**" if best and r is best else r["partitioner"]
            if not r["feasible"]:
                lines.append(
                    f"| {name} | infeasible: {r.get('error', '')} | | | | | | | {r['search_seconds']:.1f} |"
                )
                continue
            lines.append(
                f"| {name} | {r.get('samples_per_s', 0):.2f} | {r['period_s'] * 1e3:.1f} | "
                f"{r['period_s'] / c['lower_bound_s']:.3f} | {r['expected_speedup']:.2f} | {r['stages']} | "
                f"{r['max_memory_bytes'] / 2**30:.2f} | {r['comm_bytes'] / 1e6:.0f} | {r['search_seconds']:.1f} |"
            )
        if mixed and seq:
            top = max(seq, key=lambda r: r["samples_per_s"])
            lines += [
                "",
                f"Mixed-pipe vs best sequential ({top['partitioner']}): "
                f"{mixed['samples_per_s'] / top['samples_per_s']:.2f}x simulated throughput, "
                f"period {top['period_s'] / mixed['period_s']:.2f}x lower.",
            ]
        lines.append("")
    return "\n".join(lines)
