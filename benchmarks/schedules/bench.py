"""Section `schedules` of BENCHMARKS.md: GPipe, 1F1B, PipeDream-2BW, WPipe and FTPipe side by side.

    python -m benchmarks --sections schedules --out /tmp/schedules.md

For each model, every schedule is planned for with the partitioners that can produce its
placement (WPipe's loop only comes from the sequential ones), every plan is simulated under
its schedule, and the fastest that fits is the schedule's row: each at its best, on our
costs and memory model. WPipe against 2BW is then compared with the paper's claims (1.4x
throughput, -36% memory), once with each schedule's best plan and once with the same
partitioner (PipeDream's DP) for both; memory is split into what stays (weights, their
extra versions, gradients, optimizer state) and activations, to say where a difference
comes from.
"""

from __future__ import annotations

import sys
import time
from dataclasses import replace

from ftpipe_compiler.costs.profilers import costed_graph
from ftpipe_compiler.partition import problem_from_graph, run_partitioners
from ftpipe_compiler.simulate import simulate

ALONE = False  # it only computes: it may share the machine (benchmarks.sections)

CASES = [("t5-3b", "rte", "rtx2080ti", 8), ("bert-large", "squad", "rtx2080ti", 8)]
SCHEDULES = ("gpipe", "1f1b", "2bw", "wpipe", "ftpipe")
SAME = "pipedream"  # the partitioner both 2BW and WPipe get in the like-for-like comparison
PAPER = {"throughput": 1.4, "memory": -0.36}  # WPipe vs PipeDream-2BW (WPipe §4, abstract)
GIB = 2**30


def memory_split(plan) -> dict:
    """Bytes summed over the GPUs: the plan's peak, what stays without activations, and the
    weight copies beyond the first (2BW's and WPipe's second versions)."""
    still = plan.with_(stages=tuple(replace(s, input_bytes=0, act_bytes=0) for s in plan.stages))
    by_name = {p.name: p for p in plan.params}
    extra = sum(
        (plan.policies[s.id].weight_versions - 1) * by_name[n].bytes
        for s in plan.stages
        for n in s.params
        if by_name[n].trainable
    )
    total = sum(plan.gpu_memory(g) for g in range(plan.gpus))
    static = sum(still.gpu_memory(g) for g in range(plan.gpus))
    return {"total": total, "static": static, "activations": total - static, "extra": extra}


def _row(result, sim, steps: int) -> dict:
    plan = result.plan
    free = simulate(plan.with_(bandwidth=1e30), steps=steps)  # transfers take no time
    return {
        "partitioner": result.partitioner,
        "stages": len(plan.stages),
        "samples_per_s": sim.samples_per_s,
        "step_time_s": sim.step_time_s,
        "bubble_fraction": sim.bubble_fraction,
        "max_memory_bytes": sim.max_memory_bytes,
        "fits": sim.fits,
        "period_s": plan.period_s,
        # The step if every GPU ran its period back to back (FTPipe eq. 1 x micro-batches),
        # and the simulated step with free transfers: what is left is the schedule's order.
        "ideal_step_s": plan.period_s * plan.micro_batches,
        "free_links_step_s": free.step_time_s,
        "memory": memory_split(plan),
    }


def measure(cases=CASES, schedules=SCHEDULES, steps: int = 20) -> dict:
    out = []
    for model, task, hardware, gpus in cases:
        t0 = time.perf_counter()
        _, t, _, graph = costed_graph(model, task, hardware)
        case = {"model": model, "task": t.name, "hardware": hardware, "gpus": gpus, "rows": {}}
        for name in schedules:
            problem = problem_from_graph(graph, gpus, hardware, name, None, None, 0)
            case.update(micro_batch=graph.meta["micro_batch"], micro_batches=problem.micro_batches)
            case["optimizer"] = problem.optimizer
            candidates = []
            for r in run_partitioners(problem, progress=False):
                if r.feasible:
                    candidates.append(_row(r, simulate(r.plan, steps=steps), steps))
            fitting = [c for c in candidates if c["fits"]]
            best = max(fitting, key=lambda c: c["samples_per_s"], default=None)
            same = next((c for c in candidates if c["partitioner"] == SAME), None)
            case["rows"][name] = {"best": best, "same": same, "tried": len(candidates)}
        case["seconds"] = time.perf_counter() - t0
        out.append(case)
        print(
            f"  schedules: {model} on {gpus} x {hardware}: {case['seconds']:.0f} s", file=sys.stderr
        )
    return {"cases": out, "paper": PAPER, "same_partitioner": SAME}


def versus(wpipe: dict | None, two_bw: dict | None) -> dict | None:
    """WPipe / 2BW: throughput ratio and relative change of the largest GPU's memory."""
    if not wpipe or not two_bw:
        return None
    return {
        "throughput": wpipe["samples_per_s"] / two_bw["samples_per_s"],
        "memory": wpipe["max_memory_bytes"] / two_bw["max_memory_bytes"] - 1,
        "total_memory": wpipe["memory"]["total"] / two_bw["memory"]["total"] - 1,
        "extra_weights": (wpipe["memory"]["extra"], two_bw["memory"]["extra"]),
        "activations": (wpipe["memory"]["activations"], two_bw["memory"]["activations"]),
        "bubble": (wpipe["bubble_fraction"], two_bw["bubble_fraction"]),
        # Simulated step over the period bound, with transfers and with free links.
        "over_ideal": tuple(r["step_time_s"] / r["ideal_step_s"] for r in (wpipe, two_bw)),
        "over_ideal_free": tuple(
            r["free_links_step_s"] / r["ideal_step_s"] for r in (wpipe, two_bw)
        ),
    }
