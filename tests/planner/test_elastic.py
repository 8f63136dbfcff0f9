"""Freeze training simulated (planner/elastic): the frozen graph equals tracing the frozen
model, the cache is used only where it pays, and the run follows the freeze rule."""

from __future__ import annotations

import pytest
from ftpipe_runtime.freeze.layers import bound_schedule
from ftpipe_runtime.spec.weights import WRAPPER_PREFIX

from ftpipe_compiler.costs.analytic import analytic_costs
from ftpipe_compiler.costs.cluster import get_cluster
from ftpipe_compiler.costs.hardware import get_hardware
from ftpipe_compiler.graph.trace import trace_model
from ftpipe_compiler.planner.elastic import CacheOptions, FreezeRun, simulate_freezing
from ftpipe_compiler.planner.frozen_graphs import cached_graph, frozen_graph, graph_units

HW = get_hardware("rtx2080ti")


@pytest.fixture(scope="module")
def bert(tiny_bert):
    spec, task, model, traced = tiny_bert
    return spec, task, model, analytic_costs(traced, HW)


def test_frozen_graph_equals_tracing_the_frozen_model(bert):
    spec, task, _, graph = bert
    units = graph_units(graph)
    assert len(units) == 2 and units[0][0].startswith("bert.embeddings")
    frozen = frozenset(units[0])
    model = spec.build("cpu", dropout=0.0, seed=0)
    for name, p in model.named_parameters():
        p.requires_grad_(name.removeprefix(WRAPPER_PREFIX) not in frozen)
    ref = analytic_costs(trace_model(spec, task, task.micro_batch, device="cpu", model=model), HW)
    got = frozen_graph(graph, frozen)
    assert [n.id for n in got.nodes] == [n.id for n in ref.nodes]
    assert {p.name: p.trainable for p in got.params} == {p.name: p.trainable for p in ref.params}
    for a, b in zip(got.nodes, ref.nodes):
        assert a.requires_grad == b.requires_grad, a.id
        assert a.act_bytes == b.act_bytes, a.id
        assert a.bwd_s <= b.bwd_s + 1e-15, a.id  # frozen weights: no weight gradient
        assert a.fwd_s == b.fwd_s
    no_grad = [n for n in got.nodes if not n.requires_grad]
    assert any(n.params for n in no_grad)  # the frozen layer runs forward only
    assert all(n.bwd_s == 0 for n in no_grad)
    full = sum(n.bwd_s for n in graph.nodes)
    assert sum(n.bwd_s for n in got.nodes) < full


def test_cache_replaces_the_prefix_forward_by_its_read(bert):
    _, _, _, graph = bert
    units = graph_units(graph)
    g = frozen_graph(graph, frozenset(units[0]))
    cached = cached_graph(g, units, read=1, write=None, s_per_byte=1e-9)
    changed = [(a, b) for a, b in zip(g.nodes, cached.nodes) if a.fwd_s != b.fwd_s]
    assert changed and all(not a.requires_grad for a, _ in changed)
    read = sum(b.fwd_s for _, b in changed)
    # the boundary (the hidden states leaving layer 0, and the attention mask) at 1 ns a byte
    boundary = sum(b.out_bytes for a, b in changed if b.fwd_s > 0)
    assert read == pytest.approx(boundary * 1e-9)
    assert boundary >= graph.meta["micro_batch"] * 16 * 32 * 4  # batch x seq x hidden x fp32


def test_the_run_follows_the_rule_and_caches_only_where_it_pays(bert):
    _, _, _, graph = bert
    cluster = get_cluster("rtx2080ti", gpus=2)
    run = FreezeRun(alpha=0.5, epochs=3, samples=1000, batch=8, depth=2,
                    schedule="gpipe", partitioners=("pipedream",))  # fmt: skip
    got = simulate_freezing(graph, cluster, run)
    assert [i.frozen for i in got.intervals] == [0, *bound_schedule(2, 0.5, 2)]
    first = got.intervals[0]
    assert (first.shape.replicas, first.shape.depth) == (1, 2)  # T0 on K GPUs
    assert first.seconds == pytest.approx(1000 / got.baseline.samples_per_s)
    assert got.seconds <= got.no_cache_seconds
    for i in got.intervals:  # an interval without the cache is timed as planned
        if i.cache_read is None and i.cache_write is None:
            assert i.seconds == i.no_cache_seconds
    slow = simulate_freezing(graph, cluster, run, CacheOptions(host_bytes=0, disk_bandwidth=1.0))
    assert all(i.cache_read is None and i.cache_write is None for i in slow.intervals)
    assert slow.seconds == pytest.approx(slow.no_cache_seconds)
    assert got.baseline_seconds == pytest.approx(3 * 1000 / got.baseline.samples_per_s)
