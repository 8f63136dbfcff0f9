"""Messages, step points and deadlock detection derived from action lists."""

from __future__ import annotations

import pytest
from ftpipe_runtime.dataflow import action_lists, build_dataflow, check_progress
from ftpipe_runtime.errors import PipelineConfigError
from ftpipe_runtime.schedules import Action
from ftpipe_runtime.topology import Topology
from runtime_toy import toy_plan


def _acts(text: str) -> list[Action]:
    return [Action.parse(a) for a in text.split()]


def test_topology_of_the_toy():
    topo = Topology(toy_plan("two-ranks"))
    assert topo.stages_on(0) == [0, 2] and topo.stages_on(1) == [1, 3]
    assert topo.remote_ranks("x0") == [1]  # stages 1 and 3 read it: one message to rank 1
    assert topo.remote_ranks("h0") == [1] and topo.local_consumers("h0", 0) == [2]
    assert not topo.transfers["keep"].grad  # integers carry no gradient
    emb = topo.transfers["emb.weight"]  # the tied weight travels from its owner, stage 0
    assert (emb.producer, emb.consumers, emb.grad, emb.weight) == (0, (3,), True, True)
    assert topo.remote_ranks("emb.weight") == [1]
    assert not topo.transfers["x0"].weight


def test_a_plan_with_copied_weights_is_refused():
    plan = toy_plan("two-ranks")
    emb = next(p for p in plan["params"] if p["name"] == "emb.weight")
    emb["stages"] = [0, 3]  # what ftpipe wrote before weights travelled between stages
    with pytest.raises(PipelineConfigError, match="copy of emb.weight in several stages"):
        Topology(plan)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "ftpipe"])
def test_each_tensor_crosses_once_per_destination_rank(schedule):
    topo, m, steps = Topology(toy_plan("two-ranks")), 4, 2
    lists = action_lists(topo, schedule, m, steps)
    flow = build_dataflow(topo, lists, m, synchronous=schedule != "ftpipe")
    check_progress(topo, lists, flow)
    to_1, to_0 = flow.order[(0, 1)], flow.order[(1, 0)]
    mbs = range(m * steps)
    assert sorted(k for k in to_1 if k[1] == "x0") == [("act", "x0", i) for i in mbs]
    assert sorted(k for k in to_0 if k[1] == "x0") == [("grad", "x0", i) for i in mbs]
    assert not any(k[1] == "keep" and k[0] == "grad" for k in to_0)
    # The weight goes like an activation, and its gradient comes back like one.
    assert sorted(k for k in to_1 if k[1] == "emb.weight") == [
        ("act", "emb.weight", i) for i in mbs
    ]
    assert sorted(k for k in to_0 if k[1] == "emb.weight") == [
        ("grad", "emb.weight", i) for i in mbs
    ]
    # The gradient of x0 leaves rank 1 after both of its readers there ran their backward.
    for i in mbs:
        sender = flow.grad_sender[(1, "x0", i)]
        pos = {a: j for j, a in enumerate(lists[1])}
        other = 3 if sender == 1 else 1
        b = [a for a in lists[1] if a.kind == "B" and a.mb == i]
        assert (
            pos[next(a for a in b if a.stage == sender)]
            > pos[next(a for a in b if a.stage == other)]
        )


def test_steps_are_placed_per_rank_when_synchronous_per_stage_when_not():
    topo, m = Topology(toy_plan("three-ranks")), 2
    sync = build_dataflow(topo, action_lists(topo, "gpipe", m, 2), m, synchronous=True)
    assert [(e.step, e.stages, e.ranks) for e in sync.events[0].values()] == [
        (0, (0, 2), (0, 1, 2)),
        (1, (0, 2), (0, 1, 2)),
    ]
    lists = action_lists(topo, "ftpipe", m, 2)
    flow = build_dataflow(topo, lists, m, synchronous=False)
    # Stage 3 reads stage 0's weight, yet steps alone: no collective, no waiting for rank 0.
    loss = [e for e in flow.events[2].values()]
    assert [(e.stages, e.ranks) for e in loss] == [((3,), (2,))] * 2
    assert sorted((e.stages, e.step) for e in flow.events[0].values()) == [
        ((0,), 0),
        ((0,), 1),
        ((2,), 0),
        ((2,), 1),
    ]


def test_a_deadlocking_order_is_refused():
    topo = Topology(toy_plan("two-ranks", micro_batches=1))
    # Rank 1 wants stage 3's forward (needs h2 from rank 0) before it makes h1 for rank 0.
    lists = {
        0: _acts("0F0 2F0 2R0 0R0 0S0 2S0"),
        1: _acts("3F0 1F0 3B0 1R0 1S0 3S0"),
    }
    flow = build_dataflow(topo, lists, 1, synchronous=True)
    with pytest.raises(PipelineConfigError, match="deadlock.*rank 0 at 2F0.*rank 1 at 3F0"):
        check_progress(topo, lists, flow)


@pytest.mark.parametrize(
    ("rank0", "message"),
    [
        ("0R0 0F0 2F0 2R0 0S0 2S0", "before its forward"),
        ("0F0 2F0 2R0 0S0 0R0 2S0", "does not follow exactly"),
        ("0F0 1F0", "a stage it does not host"),
    ],
)
def test_malformed_lists_are_refused(rank0, message):
    topo = Topology(toy_plan("two-ranks", micro_batches=1))
    lists = {0: _acts(rank0), 1: _acts("1F0 3F0 3B0 1R0 1S0 3S0")}
    with pytest.raises(PipelineConfigError, match=message):
        build_dataflow(topo, lists, 1, synchronous=True)


def test_an_asynchronous_order_is_not_run_as_synchronous():
    topo, m = Topology(toy_plan("two-ranks")), 2
    lists = action_lists(topo, "ftpipe", m, 3)
    with pytest.raises(PipelineConfigError, match="not a synchronous schedule"):
        build_dataflow(topo, lists, m, synchronous=True)
