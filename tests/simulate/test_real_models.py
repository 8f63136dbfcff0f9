"""The simulator on plans built from traced models (t5-tiny here; T5-3B marked slow)."""

from __future__ import annotations

import time

import pytest

from ftpipe_compiler.simulate import simulate


def folded(stages: int) -> list[int]:
    """Stage i on GPU i for the first half, then back down: Mixed-pipe's 2 stages per GPU."""
    half = stages // 2
    return [i if i < half else stages - 1 - i for i in range(stages)]


def test_t5_tiny_folded_plan(tiny_t5_costed, contiguous):
    plan = contiguous(tiny_t5_costed, 8, folded(8), micro_batches=4)
    gpu = {s.id: s.gpu for s in plan.stages}
    weights = {p.name for p in plan.params}
    sent = [
        t
        for t in plan.transfers
        if t.tensor in weights and {gpu[c] for c in t.consumers} - {gpu[t.producer]}
    ]
    assert sent, "the shared embedding should cross GPUs in this layout"
    for name in ("gpipe", "1f1b", "ftpipe"):
        result = simulate(plan, name, steps=6)
        assert result.step_time_s >= plan.period_s * 4 * (1 - 1e-9)  # no plan beats its period
        assert 0 <= result.bubble_fraction < 1
        assert all(0 < g.busy_fraction <= 1 + 1e-9 for g in result.gpus)
        assert all(g.bytes_sent > 0 for g in result.gpus)


@pytest.mark.slow
def test_t5_3b_16_stages_8_gpus_100_steps(contiguous):
    """Benchmark: the issue asks for under 5 s; this only checks it runs and prints the time."""
    from ftpipe_compiler.costs.profilers import costed_graph

    _, _, _, graph = costed_graph("t5-3b")
    plan = contiguous(graph, 16, folded(16), micro_batches=10)
    t0 = time.perf_counter()
    result = simulate(plan, steps=100)
    seconds = time.perf_counter() - t0
    print(
        f"\nT5-3B, 16 stages on 8 GPUs, 100 steps of 10 micro-batches: simulated in "
        f"{seconds:.2f} s; step {result.step_time_s:.3f} s vs period x M {plan.period_s * 10:.3f} s"
    )
    assert len(result.step_ends_s) == 100


@pytest.mark.slow
def test_t5_3b_compiled_winner_runs_at_its_period_under_ftpipe(tmp_path):
    """The shared embedding travels with the micro-batches instead of being copied and summed,
    so under the async schedule no stage waits for another's step: the compiled winner runs
    within 5% of period x M (it was 8.24 s against 5.52 s when the stages holding copies of
    the embedding stepped together)."""
    from click.testing import CliRunner

    from ftpipe_compiler.cli import cli
    from ftpipe_compiler.plan import Plan

    out = tmp_path / "t5"
    args = ["compile", "--model", "t5-3b", "--gpus", "8", "--schedule", "ftpipe", "-o", str(out)]
    r = CliRunner().invoke(cli, args)
    assert r.exit_code == 0, r.output
    plan = Plan.load(out / "plan.json")
    assert plan.schedule == "ftpipe"
    gpu = {s.id: s.gpu for s in plan.stages}
    shared = next(t for t in plan.transfers if t.tensor == "shared.weight")
    assert {gpu[c] for c in shared.consumers} - {gpu[shared.producer]}  # it crosses GPUs
    result = simulate(plan)
    ideal = plan.period_s * plan.micro_batches
    print(
        f"\nT5-3B winner ({plan.partitioner}): step {result.step_time_s:.3f} s, ideal {ideal:.3f} s"
    )
    assert ideal * (1 - 1e-9) <= result.step_time_s <= 1.05 * ideal


def test_steady_runs_of_deep_t5_tiny_plans_settle_late_and_measure_alike(
    tiny_t5_costed, contiguous
):
    """Deep asynchronous plans (3 stages per GPU) take a few steps to settle: a `steady` run
    measures only the steps that settled, which give the full run's figures."""
    late = 0
    for stages, gpus, m, name in ((12, 4, 2, "ftpipe"), (12, 4, 3, "ftpipe"), (8, 4, 6, "wpipe")):
        plan = contiguous(
            tiny_t5_costed, stages, [i % gpus for i in range(stages)], micro_batches=m
        )
        full = simulate(plan, name, steps=12)
        steady = simulate(plan, name, steps=12, steady=True)
        late += 4 < steady.steps < 12
        assert steady.step_time_s == pytest.approx(full.step_time_s, rel=1e-9)
        assert steady.bubble_fraction == pytest.approx(full.bubble_fraction, rel=1e-9)
        assert simulate(plan, name, steps=12, drain=False) == full  # the drain changes nothing
    assert late == 3
