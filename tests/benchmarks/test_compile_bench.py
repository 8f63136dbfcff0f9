"""The compile section's balance figure (BENCHMARKS.md section 2, the cluster planner): each
GPU's compute per micro-batch against a hand sum over a plan's stages, and the ceiling an even
spread of it would give."""

from __future__ import annotations

import pytest
from partition.partition_helpers import make_graph, make_problem

from benchmarks.compile.bench import _balance, _balance_markdown
from ftpipe_compiler.partition import run_partitioner
from ftpipe_compiler.simulate import simulate


def test_balance_sums_each_gpus_stages_as_the_schedule_runs_them():
    r = run_partitioner(make_problem(make_graph(40, seed=3), gpus=3), "mixed")
    sim = simulate(r.plan, steps=4)
    plan = r.plan.with_(simulated={"step_time_s": sim.step_time_s})
    policies = plan.policies
    per_gpu = [0.0, 0.0, 0.0]
    for s in plan.stages:
        rec = policies[s.id].recompute
        per_gpu[s.gpu] += s.fwd_s + s.bwd_s + (s.recompute_s if rec else 0.0)
    got = _balance(plan)
    assert got["busiest_gpu_s"] == pytest.approx(max(per_gpu))
    assert got["mean_gpu_s"] == pytest.approx(sum(per_gpu) / 3)
    assert got["per_micro_batch_s"] == pytest.approx(sim.step_time_s / plan.micro_batches)


def test_the_ceiling_takes_the_imbalance_off_each_micro_batch():
    c = {"busiest_gpu_s": 0.5, "mean_gpu_s": 0.4, "per_micro_batch_s": 0.6}
    (line, _) = _balance_markdown({**c, "effective_speedup": 30.0})
    assert "at most 36.0 effective speedup" in line  # 30 x 0.6 / (0.6 - 0.1)
    assert _balance_markdown({**c, "per_micro_batch_s": 0.0, "effective_speedup": 1.0}) == []
