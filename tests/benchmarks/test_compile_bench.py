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


def test_a_timed_compile_reports_the_median_of_its_runs(tmp_path, monkeypatch):
    """`_median_compile`: the run of median total, every run's figures in the order run."""
    import benchmarks.compile.bench as bench

    totals = iter([(15.7, 19.7), (12.5, 16.3), (13.1, 17.0)])

    def fake(argv, out):
        total, wall = next(totals)
        out.mkdir(parents=True)
        return {"timings": {"total_s": total, "wall_s": wall}}

    monkeypatch.setattr(bench, "_compile", fake)
    got = bench._median_compile([], tmp_path / "out", 3)
    assert got["timings"]["total_s"] == 13.1
    assert got["runs"] == [(15.7, 19.7), (12.5, 16.3), (13.1, 17.0)]
    assert "13.1 s (17.0 s)" in bench._runs(got) and "median of 3" in bench._runs(got)
