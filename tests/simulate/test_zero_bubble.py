"""Zero-bubble and interleaved schedules in the simulator against the papers' closed forms,
with equal F, B and W times (Qi et al., ICLR'24, §3: T_F = T_B = T_W = 1 per stage).

1F1B runs B and W as one backward: its bubble is (p - 1)(T_F + T_B + T_W) per step. ZB-H1
(zb1p) defers W into the drain: (p - 1)(T_F + T_B - T_W), a third, i.e. a bubble rate
(bubble / compute) of (p - 1) / 3m. ZB-V halves the stages and keeps every GPU busy but for
the fill a flush imposes (p - 1 forwards of a half stage); ZB-H2 (zb2p, no flush) has none.
Megatron's interleaving with v chunks per GPU divides 1F1B's bubble by v.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from ftpipe_compiler.simulate import simulate


def _plan(make_plan, p, m, schedule, chunks=1, gpu_of=None):
    t = 1.0 / chunks  # a GPU's F, B and W each take 1 per micro-batch, whatever its chunks
    plan = make_plan(
        [(t, 2 * t, 0.0)] * (p * chunks), gpu_of=gpu_of, schedule=schedule, micro_batches=m
    )
    return plan.with_(stages=tuple(replace(s, wgrad_s=t) for s in plan.stages))


def _bubble(result, m):
    return result.step_time_s - 3 * m  # every GPU computes 3 per micro-batch


@pytest.mark.parametrize("p", [2, 4, 8])
@pytest.mark.parametrize("k", [1, 2, 3])
def test_zb1p_bubble_is_a_third_of_1f1b(plan_factory, p, k):
    m = k * p  # the formulas hold from m >= p on
    one_f_one_b = simulate(_plan(plan_factory, p, m, "1f1b"), steps=4)
    zb1p = simulate(_plan(plan_factory, p, m, "zb1p"), steps=4)
    assert _bubble(one_f_one_b, m) == pytest.approx(3 * (p - 1), abs=1e-9)
    assert _bubble(zb1p, m) == pytest.approx(p - 1, abs=1e-9)
    assert _bubble(zb1p, m) / (3 * m) == pytest.approx((p - 1) / (3 * m))


@pytest.mark.parametrize("p", [2, 4, 8])
@pytest.mark.parametrize("k", [2, 3])
def test_zbv_leaves_only_the_flush_fill_and_zb2p_none(plan_factory, p, k):
    m = k * p
    v_shape = [*range(p), *reversed(range(p))]
    zbv = simulate(_plan(plan_factory, p, m, "zbv", 2, v_shape), steps=4)
    zb2p = simulate(_plan(plan_factory, p, m, "zb2p"), steps=4)
    assert _bubble(zbv, m) == pytest.approx((p - 1) / 2, abs=1e-9)  # half of ZB-H1's
    assert _bubble(zb2p, m) == pytest.approx(0, abs=1e-9)


@pytest.mark.parametrize("p", [2, 4, 8])
def test_interleaving_divides_the_1f1b_bubble_by_its_chunks(plan_factory, p):
    m, v = 2 * p, 2  # `interleaved` loops twice
    looped = [i % p for i in range(v * p)]
    result = simulate(_plan(plan_factory, p, m, "interleaved", v, looped), steps=4)
    assert _bubble(result, m) == pytest.approx(3 * (p - 1) / v, abs=1e-9)


@pytest.mark.parametrize("p", [4, 8])
def test_micro_batches_held_per_the_papers(plan_factory, p):
    """ZB-H1 holds 1F1B's peak (p micro-batches) on every stage, ZB-H2 2p - 1; ZB-V's chunks
    on GPU g hold 2p - g and g + 1 micro-batches of half a stage: p + 1/2 stages' worth,
    about 1F1B's p (the paper counts the two chunks' peaks as one)."""
    m = 2 * p
    assert simulate(_plan(plan_factory, p, m, "1f1b"), steps=3).in_flight == tuple(range(p, 0, -1))
    assert simulate(_plan(plan_factory, p, m, "zb1p"), steps=3).in_flight == (p,) * p
    assert simulate(_plan(plan_factory, p, m, "zb2p"), steps=3).in_flight == (2 * p - 1,) * p
    v_shape = [*range(p), *reversed(range(p))]
    held = simulate(_plan(plan_factory, p, m, "zbv", 2, v_shape), steps=3).in_flight
    assert held == tuple(range(2 * p, 0, -1))
    assert {(held[g] + held[2 * p - 1 - g]) / 2 for g in range(p)} == {p + 0.5}
