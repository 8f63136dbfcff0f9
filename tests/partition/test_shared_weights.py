"""A parameter read by several stages lives in one, the lowest, and travels to the others."""

from __future__ import annotations

import random

import pytest
from partition_helpers import make_graph, make_problem
from test_assignment import random_assignment, random_legal_moves

from ftpipe_compiler.errors import PlanFormatError
from ftpipe_compiler.partition import build_plan
from ftpipe_compiler.partition.indexed import NodeCosts
from ftpipe_compiler.plan import Plan


def node_static_bytes(problem) -> dict[str, int]:
    """Static bytes owned by each node (tied parameters at their first reader)."""
    out = {n.id: 0 for n in problem.graph.nodes}
    for p, nid in problem.graph.owner.items():
        out[nid] += problem.static_bytes[p]
    return out


def halves(graph, gpu_of):
    """Two stages: the first half of the node order and the rest (the tied readers apart)."""
    n = len(graph.nodes)
    stage_of = {node.id: int(i >= n // 2) for i, node in enumerate(graph.nodes)}
    problem = make_problem(graph, gpus=max(gpu_of.values()) + 1)
    return build_plan(problem, stage_of, gpu_of, "test")


def test_readers_on_two_gpus_one_owner_and_a_transfer_of_the_weight(seed):
    graph = make_graph(12, seed)  # "tied" is read by the first and the last node
    plan = halves(graph, {0: 0, 1: 1})
    tied = next(p for p in plan.params if p.name == "tied")
    assert tied.stages == (0,)
    assert [("tied" in s.params, "tied" in s.inputs, "tied" in s.outputs) for s in plan.stages] == [
        (True, False, True),
        (False, True, False),
    ]
    sent = [t for t in plan.transfers if t.tensor == "tied"]
    assert [(t.producer, t.consumers, t.bytes, t.requires_grad) for t in sent] == [
        (0, (1,), tied.bytes, True)
    ]
    # Each stage reads it once: no stage holds two of its gradients (`Stage.reread`).
    assert [s.reread for s in plan.stages] == [(), ()]
    one = build_plan(make_problem(graph, gpus=1), dict.fromkeys(graph.node, 0), {0: 0}, "test")
    assert one.stages[0].reread == ("tied",)
    # Every parameter in exactly one stage.
    owned = [p for s in plan.stages for p in s.params]
    assert sorted(owned) == sorted(p.name for p in plan.params if p.stages)
    # The weight goes out and its gradient comes back, once per micro-batch each.
    acts = sum(
        t.bytes * (2 if t.requires_grad else 1) for t in plan.transfers if t.tensor != "tied"
    )
    assert plan.comm_bytes == acts + 2 * tied.bytes
    # The reader keeps the received weight per in-flight micro-batch, like any input.
    reader = plan.stages[1]
    node_inputs = sum(graph.node[t].out_bytes for t in reader.inputs if t != "tied")
    assert reader.input_bytes == node_inputs + tied.bytes
    # Its static state (weights, gradients, optimizer) only on the owner's GPU: the graph's own
    # bookkeeping puts it at the first node reading it, which is in stage 0 here.
    problem = make_problem(graph, gpus=2)
    owned = node_static_bytes(problem)
    for st in plan.stages:
        static = sum(owned[n] for n in st.nodes)
        pol = plan.policies[st.id]
        kept = pol.in_flight * (st.input_bytes if pol.recompute else st.act_bytes)
        parts = plan.gpu_memory_parts(st.gpu)
        assert parts.stages == static + kept + (st.act_bytes if pol.recompute else 0)
    assert owned[graph.nodes[0].id] >= problem.static_bytes["tied"]
    # Beside its stage, the reader's GPU sums the weight's gradient over the step, and holds
    # the weight itself where its stage keeps activations instead of inputs.
    reader_gpu = plan.gpu_memory_parts(1)
    assert reader_gpu.weight_grads == tied.bytes
    copies = 0 if plan.policies[1].recompute else tied.bytes
    assert reader_gpu.received_weights == copies
    assert plan.gpu_memory_parts(0).weight_grads == 0


def test_readers_on_one_gpu_hand_the_weight_over_without_traffic(seed):
    graph = make_graph(12, seed)
    apart, together = halves(graph, {0: 0, 1: 1}), halves(graph, {0: 0, 1: 0})
    assert any(t.tensor == "tied" for t in together.transfers)  # still handed over, in place
    tied = next(p for p in apart.params if p.name == "tied")
    assert apart.comm_bytes - together.comm_bytes >= 2 * tied.bytes
    assert together.gpu_comm_s(0) == (0.0, 0.0)


@pytest.mark.parametrize("schedule", ["ftpipe", "1f1b"])
def test_owner_edges_keep_the_numbering_topological(seed, schedule):
    """Random partitions of random DAGs: the owner is the lowest reader, every weight goes to
    higher stages, the plan validates, and depths count the weight edges."""
    rng = random.Random(seed)
    checked = 0
    for trial in range(10):
        graph = make_graph(rng.randint(5, 40), seed + trial, loss=rng.choice([-1, -2]))
        problem = make_problem(graph, gpus=rng.randint(1, 4), schedule=schedule, memory=2**50)
        lay = random_assignment(NodeCosts.of(problem), rng, problem.gpus)
        random_legal_moves(lay, rng, 30)
        plan = build_plan(problem, lay.stage_of(), lay.gpu_of(), "test")
        plan.validate()
        depth = {s.id: s.depth for s in plan.stages}
        for p in plan.params:
            readers = sorted(
                {s.id for s in plan.stages for n in s.nodes if p.name in graph.node[n].params}
            )
            assert p.stages == tuple(readers[:1])
            sent = [t for t in plan.transfers if t.tensor == p.name]
            if len(readers) < 2:
                assert not sent
                continue
            checked += 1
            assert [(t.producer, t.consumers) for t in sent] == [(readers[0], tuple(readers[1:]))]
            assert all(depth[readers[0]] > depth[r] for r in readers[1:])
    assert checked  # the tied readers did land in different stages


def test_a_plan_with_copied_weights_is_refused(seed):
    data = halves(make_graph(12, seed), {0: 0, 1: 1}).to_dict()
    tied = next(p for p in data["params"] if p["name"] == "tied")
    tied["stages"] = [0, 1]  # what ftpipe wrote when every reader held a copy
    with pytest.raises(PlanFormatError, match="copies tied into several stages"):
        Plan.from_dict(data)
