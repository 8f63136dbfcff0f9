"""Rematerialise instead of send: tiny T5's position biases and masks are recomputed by the
stages reading them when the link is slow, and the generated stages still compute the model."""

from __future__ import annotations

import functools

import pytest

pytest.importorskip("transformers")
from ftpipe_runtime.job.check import check  # noqa: E402

from ftpipe_compiler.codegen import generate_package, import_package  # noqa: E402
from ftpipe_compiler.costs.hardware import get_hardware  # noqa: E402
from ftpipe_compiler.costs.profilers import costed_graph  # noqa: E402
from ftpipe_compiler.partition import build_plan  # noqa: E402
from ftpipe_compiler.partition.problem import Problem  # noqa: E402
from ftpipe_compiler.plan import Plan  # noqa: E402
from ftpipe_compiler.plan import describe_remat as describe  # noqa: E402

GPU_OF = {0: 0, 1: 1, 2: 0, 3: 1}
SLOW = 1e3  # bytes/s: every tensor made from inputs and weights alone is worth recomputing


@functools.cache
def _t5():
    return costed_graph("t5-tiny")


def _plan(bandwidth: float, rematerialise: bool = True):
    graph = _t5()[3]
    n = len(graph.nodes)
    stage_of = {node.id: i * 4 // n for i, node in enumerate(graph.nodes)}
    problem = Problem(
        graph,
        gpus=2,
        hardware=get_hardware("rtx2080ti"),
        memory_bytes=2**50,
        link_bandwidth=bandwidth,
        rematerialise=rematerialise,
    )
    return build_plan(problem, stage_of, GPU_OF, "test")


def _activation_bytes(plan) -> int:
    """Per micro-batch, what crosses between GPUs apart from weights, gradients included."""
    params = {p.name for p in plan.params}
    gpu = {s.id: s.gpu for s in plan.stages}
    return sum(
        t.bytes
        * (2 if t.requires_grad else 1)
        * len({gpu[c] for c in t.consumers} - {gpu[t.producer]})
        for t in plan.transfers
        if t.tensor not in params
    )


def test_position_bias_is_recomputed_where_read_and_the_bytes_saved_are_counted():
    graph = _t5()[3]
    plan, sent = _plan(SLOW), _plan(SLOW, rematerialise=False)
    assert not any(s.copies for s in sent.stages) and sent.remat_saved_bytes == 0
    copies = {s.id: s.copies for s in plan.stages if s.copies}
    assert copies and 0 not in copies  # stage 0 makes them: nothing to receive
    for s in plan.stages:  # made from inputs and weights alone: every input is at hand
        local = set(s.nodes) | set(s.copies)
        assert all(set(graph.preds[x]) <= local for x in s.copies)
        assert not set(s.nodes) & set(s.copies)
    # The relative position bias embeddings are recomputed, and their weights travel instead.
    bias = [p for s in copies.values() for x in s for p in graph.node[x].params if "relative" in p]
    assert bias
    moved = {t.tensor for t in plan.transfers}
    assert set(bias) <= moved
    # What no longer crosses is what the plan says it saves.
    assert plan.remat_saved_bytes > 0
    assert _activation_bytes(sent) - _activation_bytes(plan) == plan.remat_saved_bytes
    assert "recomputed instead of sent" in describe(plan) and describe(sent) == ""
    assert Plan.from_dict(plan.to_dict()) == plan  # copies and bytes saved round-trip
    # Recomputing costs its time in the reading stages.
    assert sum(s.fwd_s for s in plan.stages) > sum(s.fwd_s for s in sent.stages)


def test_a_fast_link_recomputes_nothing():
    plan = _plan(1e15)
    assert not any(s.copies for s in plan.stages) and plan.remat_saved_bytes == 0


def test_generated_stages_with_recomputed_tensors_compute_the_model(tmp_path):
    spec, _, traced, graph = _t5()
    plan = _plan(SLOW)
    pkg = generate_package(traced, graph, plan, spec, tmp_path, command="pytest")
    mod = import_package(pkg)
    result = check(mod.STAGES, mod.load_plan(), seed=0)
    assert result.ok, result
    assert result.loss_abs_diff <= 1e-6 * abs(result.reference_loss)
