"""Every partitioner, on random DAGs and on t5-tiny: valid plans, determinism, clear errors."""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from partition_helpers import crafted_graph, make_graph, make_problem

from ftpipe_compiler.costs.hardware import get_hardware
from ftpipe_compiler.errors import FtpipeError, InfeasibleError, UnknownNameError
from ftpipe_compiler.partition import (
    PARTITIONERS,
    Result,
    get_partitioner,
    pick_best,
    run_partitioners,
)
from ftpipe_compiler.partition.problem import Problem


def _assignment(plan):
    return sorted((s.gpu, s.nodes) for s in plan.stages)


@settings(max_examples=20, deadline=None)
@given(
    n=st.integers(2, 30),
    graph_seed=st.integers(0, 10_000),
    gpus=st.integers(1, 5),
    schedule=st.sampled_from(["ftpipe", "gpipe", "1f1b"]),
    tight=st.booleans(),
    loss=st.sampled_from([-1, -2, 0]),
)
def test_every_plan_is_valid_or_clearly_infeasible(n, graph_seed, gpus, schedule, tight, loss):
    graph = make_graph(n, graph_seed, loss=loss)
    memory = 2**30
    if tight:  # about what the weights need spread evenly, so some partitioners fail
        total = sum(make_problem(graph, 1).static_bytes.values())
        memory = total // gpus + total // (2 * gpus)
    problem = make_problem(graph, gpus, memory=memory, schedule=schedule, seed=graph_seed)
    for name, fn in PARTITIONERS.items():
        try:
            plan = fn(problem)
        except InfeasibleError as e:
            assert "infeasible: needs" in str(e) and name in str(e)
            assert tight
            continue
        try:
            plan.validate()  # every node once, acyclic stage graph, topological, within memory
        except FtpipeError as e:  # a cut that does not fit, returned for the check to say so
            assert "more than its" in str(e) and tight, e
            continue
        assert plan.partitioner == name
        assert {i for s in plan.stages for i in s.nodes} == {nd.id for nd in graph.nodes}
        assert len({s.gpu for s in plan.stages}) <= gpus
        assert plan.period_s >= problem.lower_bound() * (1 - 1e-9)
        assert plan.search_seconds > 0


@pytest.mark.parametrize("name", list(PARTITIONERS))
def test_same_seed_same_plan(name, seed):
    graph = make_graph(40, seed)
    a = get_partitioner(name)(make_problem(graph, 3, seed=seed))
    b = get_partitioner(name)(make_problem(graph, 3, seed=seed))
    assert _assignment(a) == _assignment(b)


def test_all_partitioners_on_tiny_t5_costed(tiny_t5_costed):
    from ftpipe_compiler.costs.hardware import get_hardware
    from ftpipe_compiler.partition.problem import Problem

    problem = Problem(
        tiny_t5_costed, 2, get_hardware("rtx2080ti"), "ftpipe", "adafactor", micro_batches=4
    )
    results = run_partitioners(problem, progress=False)
    assert [r.partitioner for r in results] == list(PARTITIONERS)
    for r in results:
        assert r.feasible, r.error
        r.plan.validate()
        assert 1.0 < r.plan.expected_speedup <= 2.0 + 1e-9
    best = pick_best(results)
    assert best.plan.period_s == min(r.plan.period_s for r in results)


def test_too_little_memory_is_a_clear_infeasible_result(seed):
    graph = make_graph(20, seed)
    total = sum(make_problem(graph, 1).static_bytes.values())
    loose = make_problem(graph, 2)  # what a GPU holds beside its stages' weights and state:
    beside = loose.capacity - loose.memory  # a backward's gradient, receive buffers
    problem = make_problem(graph, 2, memory=total // 4 + beside)
    results = run_partitioners(problem, progress=False)
    for r in results:
        assert not r.feasible and r.plan is None
        assert r.error.startswith(f"{r.partitioner}: infeasible: needs 4 GPUs")
        assert r.to_json()["error"] == r.error and r.to_json()["period_s"] is None
    with pytest.raises(InfeasibleError, match="no partitioner found a plan that fits"):
        pick_best(results)


def test_unknown_partitioner_names_the_choices():
    with pytest.raises(
        UnknownNameError, match="unknown partitioner 'foo'; choose from acyclic, even-layers"
    ):
        get_partitioner("foo")
    with pytest.raises(ValueError):
        run_partitioners(make_problem(make_graph(5, 0), 2), names=["mixed", "foo"], progress=False)


def test_pick_best_uses_the_score_then_bytes_then_name(seed):
    problem = make_problem(make_graph(30, seed), 3)
    results = run_partitioners(
        problem, names=["even-layers", "params", "pipedream"], progress=False
    )
    by_period = pick_best(results)
    assert by_period.plan.period_s == min(r.plan.period_s for r in results)
    by_stages = pick_best(results, score=lambda plan: -plan.period_s)  # any score the caller likes
    assert by_stages.plan.period_s == max(r.plan.period_s for r in results)
    tied = pick_best(results, score=lambda plan: 0.0)
    assert tied.plan.comm_bytes == min(r.plan.comm_bytes for r in results)
    d = by_period.to_json()
    assert set(d) == {
        "partitioner",
        "feasible",
        "period_s",
        "expected_speedup",
        "stages",
        "max_memory_bytes",
        "comm_bytes",
        "search_seconds",
    }
    assert d["stages"] == len(by_period.plan.stages) and d["feasible"] is True
    assert isinstance(Result("x", None, False, "x: infeasible", 0.1).to_json()["error"], str)


def test_a_card_its_reserve_fills_is_infeasible_with_the_reason():
    """Issue 31: a GPU holds its CUDA context and communicators beside the run's tensors; a
    card no bigger than its context holds nothing, and a plan on a real card carries the
    reserve it counts (`Plan.gpu_memory_parts`)."""
    graph = crafted_graph([1e-3] * 4, [4_000_000] * 4)
    gpu = get_hardware("rtx2080ti")
    problem = Problem(graph, 2, gpu, "gpipe", memory_bytes=gpu.memory_reserve.context_bytes)
    assert problem.memory == 0
    (r,) = run_partitioners(problem, ["even-layers"], progress=False)
    assert not r.feasible and "less the device's reserve" in r.error
    (r,) = run_partitioners(replace(problem, memory_bytes=0), ["even-layers"], progress=False)
    assert r.feasible and r.plan.reserve == gpu.memory_reserve
    fixed = gpu.memory_reserve.context_bytes + 3 * gpu.memory_reserve.communicator_bytes
    assert r.plan.gpu_memory_parts(0).reserve > fixed  # and the fragmentation
