"""Mixed-pipe pieces: the §4.3 re-costing of the loss stage, stages per GPU, sublayer keys."""

from __future__ import annotations

from dataclasses import replace

import networkx as nx
import pytest
from partition_helpers import MB, crafted_graph, make_graph, make_problem, tied_chain

from ftpipe_compiler.errors import InfeasibleError
from ftpipe_compiler.graph.granularity import sublayer_key
from ftpipe_compiler.partition.assignment import Assignment
from ftpipe_compiler.partition.indexed import NodeCosts
from ftpipe_compiler.partition.mixed import assign, lpt, mixed, stages


def test_loss_stage_recosting_finds_the_better_assignment():
    """Blocks of 6, 4, 4 and a loss block of 7 (3.5 without recompute), on 2 GPUs.

    One LPT pass with recompute costs puts the loss block first: period 10. Re-costing what
    landed in the loss stage (§4.3) reaches 6 + 3.5 = 9.5 on one GPU and 4 + 4 on the other.
    """
    costs = NodeCosts.of(
        make_problem(crafted_graph([3.0, 2.0, 2.0, 3.5], [0] * 4, recompute=True), gpus=2)
    )
    blocks = [[0], [1], [2], [3]]
    once = Assignment(costs, *stages(costs, blocks, lpt(costs, blocks)))
    assert once.period() == pytest.approx(10.0)
    assert assign(costs, blocks).period() == pytest.approx(9.5)


def test_stages_split_where_a_path_leaves_the_gpu_and_returns(seed):
    # Chain a -> b -> c with a and c on GPU 0, b on GPU 1: a and c cannot be one stage.
    costs = NodeCosts.of(make_problem(crafted_graph([1.0, 1.0, 1.0, 1.0], [0] * 4), gpus=2))
    stage_of, gpu_of = stages(costs, [[0], [1], [2], [3]], [0, 1, 0, 0])
    assert stage_of[0] != stage_of[2]
    assert stage_of[2] == stage_of[3]  # connected on one GPU: joined
    assert gpu_of[stage_of[0]] == gpu_of[stage_of[2]] == 0
    # On random DAGs with random GPUs, the stage graph is always acyclic.
    import random

    rng = random.Random(seed)
    for trial in range(10):
        costs = NodeCosts.of(make_problem(make_graph(40, seed + trial), gpus=3))
        blocks = [[i] for i in range(costs.n)]
        stage_of, gpu_of = stages(costs, blocks, [rng.randrange(3) for _ in blocks])
        sg = nx.DiGraph(
            (stage_of[i], stage_of[j])
            for i in range(costs.n)
            for j in costs.succs[i]
            if stage_of[i] != stage_of[j]
        )
        assert nx.is_directed_acyclic_graph(sg)


def test_mixed_on_tiny_t5_costed_balances_better_than_one_gpu(tiny_t5_costed):
    from ftpipe_compiler.costs.hardware import get_hardware
    from ftpipe_compiler.partition.problem import Problem

    problem = Problem(
        tiny_t5_costed, 4, get_hardware("rtx2080ti"), "ftpipe", "adafactor", micro_batches=4
    )
    plan = mixed(problem)
    plan.validate()
    assert plan.expected_speedup > 2.0  # tiny model: transfers and small ops limit the gain
    assert plan.period_s >= problem.lower_bound() * (1 - 1e-9)


@pytest.mark.parametrize(
    "scope, key",
    [
        ("encoder.block.3.layer.0.SelfAttention.q", "encoder.block.3.layer.0"),
        ("transformer.h.7.attn.c_attn", "transformer.h.7.attn.c_attn"),
        ("lm_head", "lm_head"),
        ("", ""),
    ],
)
def test_sublayer_key(scope, key):
    assert sublayer_key(scope) == key


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("schedule", ["ftpipe", "1f1b"])
def test_judged_lazily_in_the_same_order_as_every_plan_simulated(monkeypatch, seed, schedule):
    """`_judged` simulates a plan only when its floor may beat the steps simulated so far,
    and gives the plans in the order of judging them all; no floor, less its slack, is
    above its step."""
    import ftpipe_compiler.partition.mixed as mx

    seen = []
    real = mx._fitting

    def keep(problem, cuts, t0):
        seen.append([c.plan for c in cuts])
        return real(problem, cuts, t0)

    monkeypatch.setattr(mx, "_fitting", keep)
    mixed(make_problem(make_graph(40, seed), gpus=4, schedule=schedule))
    (plans,) = seen
    everything = sorted((mx._judge(plan), k) for k, plan in enumerate(plans))
    assert list(mx._judged(plans, {})) == everything
    slack = 1 - mx.FLOOR_SLACK
    assert all(mx._floor(plans[k]) * slack <= key[0] for key, k in everything)


@pytest.mark.parametrize("seed", range(4))
def test_parts_joined_give_the_plan_of_one_search(seed):
    """A search in parts (side by side in a planner's workers) gives the plan of the search
    in one piece."""

    problem = make_problem(make_graph(40, seed), gpus=4, schedule="ftpipe")
    whole = _joined(problem, 1)
    assert _joined(problem, 2) == _joined(problem, 3) == whole


def test_parts_joined_refit_as_one_search(monkeypatch):
    """Where the plan's full count finds a cut over (`partition/fit.py`), the joined parts
    refine that cut again from where its part left it, as the search in one piece does."""
    import ftpipe_compiler.partition.mixed as mx

    loose = tied_chain()
    refits = []
    real = mx.refit
    monkeypatch.setattr(mx, "refit", lambda *a: refits.append(1) or real(*a))
    for extra in range(40, 100, 6):
        problem = replace(loose, memory_bytes=loose.capacity - loose.memory + extra * MB)
        assert _joined(problem, 2) == _joined(problem, 1), extra
    assert refits


def _joined(problem, n: int):
    import ftpipe_compiler.partition.mixed as mx

    try:
        plan = mx.join(problem, [mx.part(problem, i, n) for i in range(n)])
    except InfeasibleError as e:
        return str(e)
    return {**plan.to_dict(), "search_seconds": 0}
