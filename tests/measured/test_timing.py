"""Are the measured times real? Per-layer forward times follow the FLOPs, and the blocks add
up to the unpartitioned model's step, timed the same way (figures of one run each)."""

from __future__ import annotations

import itertools
import random
import statistics

import pytest

from ftpipe_compiler.costs.blocks import plan_blocks, run_blocks
from ftpipe_compiler.costs.measured import clock_for, measure_stages, measured_costs
from ftpipe_compiler.costs.profilers import costed_graph
from ftpipe_compiler.costs.weights import Weights


def measure_step(traced, spec, device="cpu", repeats=3, seed=0):
    """The unpartitioned model timed as ONE block (all parameters at once: small models only)."""
    clock = clock_for(device)
    members = tuple(m for n in traced.graph.nodes for m in n.members)
    blocks = plan_blocks(traced, [("model", members)], clock.device)
    weights = Weights(traced, spec, clock.device, seed)
    return run_blocks(traced, blocks, weights, clock, repeats, seed)["timings"]["model"]


def ranks(xs) -> list[float]:
    """1-based ranks; ties share the mean of the ranks they span."""
    order = sorted(range(len(xs)), key=lambda i: xs[i])
    out = [0.0] * len(xs)
    for _, grp in itertools.groupby(enumerate(order), key=lambda p: xs[p[1]]):
        grp = list(grp)
        mean = (grp[0][0] + grp[-1][0]) / 2 + 1
        for _, i in grp:
            out[i] = mean
    return out


def spearman(a, b) -> float:
    """Pearson's correlation of the ranks (the definition that handles ties)."""
    ra, rb = ranks(a), ranks(b)
    ma, mb = sum(ra) / len(ra), sum(rb) / len(rb)
    cov = sum((x - ma) * (y - mb) for x, y in zip(ra, rb))
    va = sum((x - ma) ** 2 for x in ra) ** 0.5
    vb = sum((y - mb) ** 2 for y in rb) ** 0.5
    return cov / (va * vb)


def test_spearman_against_the_no_ties_formula(seed):
    for n in (5, 12):
        a = random.sample(range(100), n)
        b = random.sample(range(100), n)
        d2 = sum((x - y) ** 2 for x, y in zip(ranks(a), ranks(b)))
        assert spearman(a, b) == pytest.approx(1 - 6 * d2 / (n * (n * n - 1)))
    assert spearman([1, 2, 2, 3], [10, 20, 20, 30]) == pytest.approx(1.0)
    assert spearman([1, 2, 3], [3, 2, 1]) == pytest.approx(-1.0)


@pytest.fixture(scope="module")
def profiled(gpt2_small):
    spec, _, traced, _ = costed_graph(gpt2_small, seq_len=128, micro_batch=4, granularity="layer")
    return spec, traced


def test_forward_times_follow_the_flops(profiled, one_thread, seed):
    spec, traced = profiled
    graph = measured_costs(traced, spec, granularity="layer", repeats=3, cache=False)
    rho = spearman([n.flops for n in graph.nodes], [n.fwd_s for n in graph.nodes])
    print(f"Spearman(forward time, FLOPs) over {len(graph.nodes)} blocks: {rho:.3f}")
    assert rho >= 0.8


def test_blocks_add_up_to_the_whole_step(profiled, one_thread, seed):
    """Other processes share the CPU, and their load changes from second to second: each
    round times the blocks and the whole model back to back, and the median round counts."""
    spec, traced = profiled
    ratios, recomputes = [], []
    for _ in range(5):
        graph = measured_costs(traced, spec, granularity="layer", repeats=2, cache=False)
        step = measure_step(traced, spec, repeats=2)
        blocks = sum(n.fwd_s + n.bwd_s for n in graph.nodes)
        ratios.append(blocks / (step.fwd_s + step.bwd_s))
        blocks = sum(n.recompute_s + n.bwd_s for n in graph.nodes)
        recomputes.append(blocks / (step.recompute_s + step.bwd_s))
    ratio, recompute = statistics.median(ratios), statistics.median(recomputes)
    print(f"sum of blocks / whole step: forward+backward {ratio:.3f} (rounds {ratios}), "
          f"recompute+backward {recompute:.3f}")  # fmt: skip
    assert 0.75 <= ratio <= 1.25
    assert 0.75 <= recompute <= 1.25


def test_a_stage_is_timed_as_one_block(profiled, one_thread, seed):
    """A plan's stages, each run as a whole: one stage holding the model is the model timed
    as one block, and two halves take about as long as the whole."""
    spec, traced = profiled
    ids = [n.id for n in traced.graph.nodes]
    half = len(ids) // 2
    halves = measure_stages(traced, spec, [(0, ids[:half]), (1, ids[half:])], repeats=2)
    whole = measure_stages(traced, spec, [(0, ids)], repeats=2)[0]
    assert set(halves) == {0, 1}
    assert all(t.fwd_s > 0 and t.recompute_s > 0 and t.bwd_s > 0 for t in halves.values())
    assert whole.act_bytes == measure_step(traced, spec, repeats=1).act_bytes
    ratio = sum(t.fwd_s + t.bwd_s for t in halves.values()) / (whole.fwd_s + whole.bwd_s)
    assert 0.7 <= ratio <= 1.4
