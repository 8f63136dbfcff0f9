"""Per-GPU memory of PipeDream-2BW and WPipe, simulated and planned, against the papers.

Hand-built uniform pipelines: d stages (2BW) or 2d half-size stages in a loop (WPipe), each
stage with `W` bytes of weights (SGD: one gradient buffer, no optimizer state), `INP` bytes
of stage inputs and `ACT` bytes of activations per micro-batch. The figures are the stages'
own (`GpuMemory.stages`: what the papers count): two copies of a versioned stage's weights, as
the papers hold them (`formulas.weight_copies`; a recomputing stage runs the next step's
forwards on the live weights, and the step replacing them sets their version aside). Until
2026-11-30 the runtime set that version aside at those forwards: a third copy, counted.
"""

from __future__ import annotations

import pytest

from ftpipe_compiler.simulate import simulate

W, INP, ACT = 4_000_000, 1_000, 300_000
BIG = 10**12


def uniform(make_plan, schedule: str, d: int, m: int, inputs: int = INP):
    """The model cut into d equal stages (2BW), or 2d half stages, GPU i holding i and d + i."""
    if schedule == "wpipe":
        plan = make_plan(
            [(0.5, 1.0, 0.5)] * (2 * d),
            gpu_of=[p % d for p in range(2 * d)],
            schedule="wpipe",
            micro_batches=m,
            memory_bytes=BIG,
        )
        share = 2
    else:
        plan = make_plan(
            [(1.0, 2.0, 1.0)] * d, schedule=schedule, micro_batches=m, memory_bytes=BIG
        )
        share = 1
    stages = tuple(s.__class__(**{**s.__dict__, "input_bytes": inputs, "act_bytes": ACT // share})
                   for s in plan.stages)  # fmt: skip
    params = tuple(
        p.__class__(**{**p.__dict__, "bytes": W // share, "static_bytes": 2 * W // share})
        for p in plan.params
    )
    return plan.with_(stages=stages, params=params)


def both(plan) -> list[tuple[int, int]]:
    """(simulated, planned) peak bytes of every GPU's stages."""
    sim = simulate(plan, steps=6)
    flight = {s.id: n for s, n in zip(plan.stages, sim.in_flight)}
    return [
        (plan.gpu_memory_parts(g, flight).stages, plan.gpu_memory_parts(g).stages)
        for g in range(plan.gpus)
    ]


@pytest.mark.parametrize("d,m", [(4, 4), (4, 8), (8, 8)])
def test_2bw_matches_its_worst_case_formula(plan_factory, d, m):
    """PipeDream-2BW §3.1: with recomputation the worst-case footprint per worker is
    (1/d)(2|W| + d |A_inp| + |A| - |A_inp|) for |W| the model's weights, |A_inp| its stage
    inputs and |A| its activations per micro-batch (inputs included); we add the gradient
    buffer (|W|/d), which the formula leaves out. Stage i holds min(m, d - i) inputs."""
    plan = uniform(plan_factory, "2bw", d, m)
    model_w, model_inp, model_act = d * W, d * INP, d * (ACT + INP)
    paper = (2 * model_w + d * model_inp + model_act - model_inp) // d + W
    got = both(plan)
    assert got[0] == (paper, paper)  # stage 0: the worst case
    for i, (sim, planned) in enumerate(got[:-1]):
        assert sim == planned == 2 * W + W + min(m, d - i) * INP + ACT
    # The loss stage keeps its activations for its one micro-batch instead of recomputing, and
    # steps before it runs ahead: the paper's two copies.
    assert got[-1] == (3 * W + ACT,) * 2


@pytest.mark.parametrize("d,m", [(4, 4), (8, 8), (4, 8)])
def test_wpipe_halves_2bw_weight_and_activation_redundancy(plan_factory, d, m):
    """WPipe Table 1 (recomputation, stage inputs ignored as the table does): the weight
    buffer is S_m against 2BW's 2 S_m, i.e. only G0 keeps a second version, and the active
    activations 0.5 S_a against S_a: a GPU recomputes one of its two half stages at a time."""
    two_bw, wpipe = (
        both(uniform(plan_factory, "2bw", d, m, inputs=0)),
        both(uniform(plan_factory, "wpipe", d, m, inputs=0)),
    )
    for g in range(d - 1):  # the last GPU holds the loss stage, which does not recompute
        # Two versions, gradients, one activation.
        assert two_bw[g] == (2 * W + W + ACT,) * 2
        # G0: two versions of half the weights; G1: one; gradients of both; half an
        # activation.
        assert wpipe[g] == (2 * (W // 2) + W // 2 + W + ACT // 2,) * 2
        # 2BW's redundancy on a GPU: W (the version beyond the live weights) + ACT (the
        # active activation); WPipe's half of it.
        assert two_bw[g][0] - wpipe[g][0] == (W + ACT) // 2
    # Summed over the GPUs: weight copies beyond the first, |W| for 2BW and |W| / 2 for WPipe.
    extra = {
        name: sum(
            (plan.policies[s.id].weight_versions - 1) * W // (2 if name == "wpipe" else 1)
            for s in plan.stages
        )
        for name, plan in (
            ("2bw", uniform(plan_factory, "2bw", d, m)),
            ("wpipe", uniform(plan_factory, "wpipe", d, m)),
        )
    }
    assert extra == {"2bw": d * W, "wpipe": d * W // 2}


def test_wpipe_holds_the_inputs_its_streams_keep(plan_factory):
    """With inputs counted: G0 keeps m + min(m, d - i) micro-batches (the next step's
    forwards run ahead of this step's backwards), G1 min(m, d - i); simulated = planned."""
    d, m = 4, 6
    plan = uniform(plan_factory, "wpipe", d, m)
    sim = simulate(plan, steps=6)
    assert sim.in_flight == tuple(
        [m + min(m, d - i) for i in range(d)] + [min(m, d - i) for i in range(d)]
    )
    for g in sim.gpus:
        held = INP * (sim.in_flight[g.gpu] + sim.in_flight[d + g.gpu])
        weights = 2 * (W // 2) + W // 2 + W  # G0's two versions, G1's, the gradients
        act = ACT // 2 * (2 if g.gpu == d - 1 else 1)  # the loss stage keeps its activation
        assert (
            plan.gpu_memory_parts(g.gpu, dict(enumerate(sim.in_flight))).stages
            == plan.gpu_memory_parts(g.gpu).stages
            == weights + held + act - (INP if g.gpu == d - 1 else 0)
        )
