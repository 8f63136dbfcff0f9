"""Bytes per step of one compiled plan, three ways: what each saving is worth on the same plan.

    rows = bytes_three_ways(plan, model="t5-3b")   # {"today": MB, "no_remat": MB, ...}

The plan's own stages and GPUs, simulated (the simulator sends what the runtime sends):
- today: a weight read by other stages goes once per version of its owner's weights, its
  gradient once per step, and cheap tensors made from inputs and weights alone are
  recomputed by their readers (partition/remat.py);
- no_remat: the same stages built again with rematerialisation off (those tensors sent);
- before: no rematerialisation and every weight sent with each micro-batch that reads it,
  its gradient back with each backward (`simulate(..., weights_once=False)`), as the
  runtime did before both changes: the like-for-like "before" of this plan.
"""

from __future__ import annotations

from dataclasses import replace

from ftpipe_compiler.costs.profilers import costed_graph
from ftpipe_compiler.partition import build_plan, problem_from_graph
from ftpipe_compiler.simulate import simulate

MB = 1e6
STEPS = 10  # as `ftpipe compile` simulates its winner


def _sent(plan, **options) -> float:
    return sum(g.bytes_sent for g in simulate(plan, steps=STEPS, **options).gpus) / MB


def bytes_three_ways(plan, model: str, task: str | None = None) -> dict:
    """MB per step of `plan` (compiled for `model`) as it is, without rematerialisation, and
    without either saving."""
    graph = costed_graph(model, task, plan.model["hardware"])[3]
    problem = problem_from_graph(
        graph, plan.gpus, plan.model["hardware"], plan.schedule, None, None, 0
    )
    stage_of = {n: s.id for s in plan.stages for n in s.nodes}
    gpu_of = {s.id: s.gpu for s in plan.stages}
    sent = build_plan(replace(problem, rematerialise=False), stage_of, gpu_of, plan.partitioner)
    today, before = _sent(plan), _sent(sent, weights_once=False)
    return {
        "stages": len(plan.stages),
        "micro_batches": plan.micro_batches,
        "today_mb": today,
        "no_remat_mb": _sent(sent),
        "before_mb": before,
        "remat_saved_mb_per_micro_batch": plan.remat_saved_bytes / MB,
        "reduction": 1 - today / before,
    }


def markdown(data: dict) -> str:
    b = data
    return (
        f"Bytes sent per step by this plan ({b['stages']} stages, {b['micro_batches']} "
        f"micro-batches, simulated): {b['today_mb']:,.0f} MB as compiled; "
        f"{b['no_remat_mb']:,.0f} MB with the same stages and no rematerialisation; "
        f"{b['before_mb']:,.0f} MB with neither (every weight read by other stages sent with "
        f"each micro-batch, as before): {b['reduction']:.1%} fewer bytes than before "
        f"(target >= 30%). Rematerialisation keeps "
        f"{b['remat_saved_mb_per_micro_batch']:,.0f} MB per micro-batch off the links. The "
        "package's `--check` needs the whole model and its reference with gradients (~46 GB), "
        "more than this machine has; tests/partition/test_remat.py checks a tiny T5 package "
        "with every such tensor recomputed: loss and gradients equal the model's."
    )
