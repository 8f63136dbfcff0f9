"""METIS repair: whatever the parts, the stages form an acyclic pipeline."""

from __future__ import annotations

import random

import networkx as nx
from hypothesis import given, settings
from hypothesis import strategies as st
from partition_helpers import make_graph, make_problem

from ftpipe_compiler.partition.assignment import Assignment
from ftpipe_compiler.partition.coarsen import atoms
from ftpipe_compiler.partition.indexed import NodeCosts
from ftpipe_compiler.partition.metis import kway, ranked, split
from ftpipe_compiler.partition.mixed import stages


def stage_graph(costs: NodeCosts, stage_of: list[int]) -> nx.DiGraph:
    g = nx.DiGraph()
    g.add_nodes_from(set(stage_of))
    g.add_edges_from(
        (stage_of[i], stage_of[j])
        for i in range(costs.n)
        for j in costs.succs[i]
        if stage_of[i] != stage_of[j]
    )
    return g


@settings(max_examples=30, deadline=None, derandomize=True)  # the same cases every run
@given(
    n=st.integers(2, 40),
    graph_seed=st.integers(0, 10_000),
    parts=st.integers(1, 6),
    label_seed=st.integers(0, 10_000),
)
def test_repairs_of_arbitrary_parts_are_acyclic(n, graph_seed, parts, label_seed):
    """Any labelling, not only METIS's: the repairs must never yield a cyclic stage graph."""
    costs = NodeCosts.of(make_problem(make_graph(n, graph_seed), gpus=parts))
    parts = costs.problem.gpus  # (a problem has no more GPUs than nodes)
    units = atoms(costs).groups()
    rng = random.Random(label_seed)
    part = [rng.randrange(parts) for _ in units]
    stage_of, gpu_of = ranked(costs, units, part)
    assert nx.is_directed_acyclic_graph(stage_graph(costs, stage_of))
    blocks, gpu = split(costs, units, part)
    assert sorted(i for b in blocks for i in b) == list(range(costs.n))
    part_of_node = {i: part[k] for k, u in enumerate(units) for i in u}
    assert all(part_of_node[i] == g for b, g in zip(blocks, gpu) for i in b)  # a block is one part
    stage_of, gpu_of = stages(costs, blocks, gpu)
    assert nx.is_directed_acyclic_graph(stage_graph(costs, stage_of))
    Assignment(costs, stage_of, gpu_of)  # renumbers topologically; raises on a cycle


def test_kway_uses_every_part_and_is_deterministic(seed):
    costs = NodeCosts.of(make_problem(make_graph(60, seed), gpus=4))
    units = atoms(costs).groups()
    a = kway(costs, units, 4, seed, 30)
    assert a == kway(costs, units, 4, seed, 30)
    assert set(a) == {0, 1, 2, 3}
    assert kway(costs, units, 1, seed, 30) == [0] * len(units)
