"""Messages, step points and weight versions derived from action lists; lists the plan's
stage graph cannot run are refused by `validate`."""

from __future__ import annotations

import pytest
from ftpipe_runtime.engine.dataflow import Dataflow
from ftpipe_runtime.errors import PipelineConfigError
from ftpipe_runtime.schedules import (
    Action,
    ScheduleError,
    Timeline,
    Versions,
    get_schedule,
    validate,
)
from ftpipe_runtime.spec.topology import Topology
from runtime_toy import toy_plan


def _acts(text: str) -> list[Action]:
    return [Action.parse(a) for a in text.split()]


def _flow(topo, sched, m, steps) -> Dataflow:
    timeline = Timeline(sched, topo.stage_infos(), m, steps)
    timeline.check(topo.stage_graph())
    return Dataflow(topo, timeline)


def _keys(flow, src, dst) -> list:
    stream, out = flow.keys(src, dst), []
    while (key := stream.get(len(out))) is not None:
        out.append(key)
    return out


def _events(flow, rank) -> list:
    return [item.event for item in flow.actions(rank) if item.event is not None]


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
    with pytest.raises(PipelineConfigError, match="copies emb.weight into several stages"):
        Topology(plan)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "ftpipe", "2bw", "wpipe"])
def test_each_tensor_crosses_once_per_destination_rank(schedule):
    topo, m, steps = Topology(toy_plan("two-ranks")), 4, 2
    flow = _flow(topo, get_schedule(schedule), m, steps)
    to_1, to_0 = _keys(flow, 0, 1), _keys(flow, 1, 0)
    assert flow.peers() == [(0, 1), (1, 0)]
    mbs = range(m * steps)
    assert sorted(k for k in to_1 if k[1] == "x0") == [("act", "x0", i) for i in mbs]
    assert sorted(k for k in to_0 if k[1] == "x0") == [("grad", "x0", i) for i in mbs]
    assert not any(k[1] == "keep" and k[0] == "grad" for k in to_0)
    weights = sorted(k for k in to_1 if k[1] == "emb.weight")
    weight_grads = sorted(k for k in to_0 if k[1] == "emb.weight")
    # A weight changes only at its owner's step: it goes once per version its owner's
    # forwards read (counted here from rank 0's list), its gradient (summed over the step's
    # micro-batches) comes back once per step.
    pol, versions, taken = flow.policies[0], set(), 0
    for a in flow.timeline.lists()[0]:
        if a.stage == 0 and a.kind == "S":
            taken += 1
        elif a.stage == 0 and a.kind == "F":
            pinned = pol.version(a.mb, m)
            versions.add(taken if pinned is None else pinned)
    assert weights == [("weight", "emb.weight", v) for v in sorted(versions)]
    assert weight_grads == [("wgrad", "emb.weight", k) for k in range(steps)]
    expected = {"ftpipe": [0, 1], "2bw": [0], "wpipe": [0]}.get(schedule, list(range(steps)))
    assert sorted(versions) == expected  # 2BW's and WPipe's step 1 reads version 0
    # The gradient of x0 leaves rank 1 after both of its readers there ran their backward.
    backwards = [item for item in flow.actions(1) if item.action.kind == "B"]
    for i in mbs:
        mine = [item for item in backwards if item.action.mb == i]
        assert [item.sends_grad("x0") for item in mine] == [False, True]
        assert {item.action.stage for item in mine} == {1, 3}


def test_steps_are_placed_per_rank_when_synchronous_per_stage_when_not():
    topo, m = Topology(toy_plan("three-ranks")), 2
    gpipe, ftpipe = get_schedule("gpipe"), get_schedule("ftpipe")
    sync = _flow(topo, gpipe, m, 2)
    assert [(e.step, e.stages, e.ranks) for e in _events(sync, 0)] == [
        (0, (0, 2), (0, 1, 2)),
        (1, (0, 2), (0, 1, 2)),
    ]
    # A step window ends at the rank's last S of each step, synchronous or not.
    assert [item.ends_step for item in sync.actions(0) if item.ends_step is not None] == [0, 1]
    flow = _flow(topo, ftpipe, m, 2)
    assert [item.ends_step for item in flow.actions(0) if item.ends_step is not None] == [0, 1]
    # Stage 3 reads stage 0's weight, yet steps alone: no collective, no waiting for rank 0.
    loss = _events(flow, 2)
    assert [(e.stages, e.ranks) for e in loss] == [((3,), (2,))] * 2
    assert sorted((e.stages, e.step) for e in _events(flow, 0)) == [
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
    with pytest.raises(
        PipelineConfigError,
        match="deadlock: GPU 0 at 2F0 waits for 1F0; GPU 1 at 3F0 waits for 2F0",
    ):
        validate(lists, topo.stage_graph(), get_schedule("1f1b"), 1, 1)


@pytest.mark.parametrize(
    ("rank0", "message"),
    [
        ("0R0 0F0 2F0 2R0 0S0 2S0", "0R0 comes before 0F0 on GPU 0"),
        ("0F0 2F0 2R0 0S0 0R0 2S0", "0S0 on GPU 0 does not follow exactly the 1 backwards"),
        ("0F0 1F0", "1F0 is on GPU 0, but stage 1 is on GPU 1"),
        ("0F0 2F0 2R0 0R0 2S0", "0S0 is missing: stage 0 never runs its optimizer step of step 0"),
    ],
)
def test_malformed_lists_are_refused(rank0, message):
    topo = Topology(toy_plan("two-ranks", micro_batches=1))
    lists = {0: _acts(rank0), 1: _acts("1F0 3F0 3B0 1R0 1S0 3S0")}
    with pytest.raises(PipelineConfigError, match=message):
        validate(lists, topo.stage_graph(), get_schedule("1f1b"), 1, 1)


def test_an_asynchronous_order_is_not_run_as_synchronous():
    topo, m = Topology(toy_plan("two-ranks")), 4
    lists = Timeline(get_schedule("ftpipe"), topo.stage_infos(), m, 3).lists()
    with pytest.raises(PipelineConfigError, match="0F4 needs the weights of stage 0 after 1"):
        validate(lists, topo.stage_graph(), get_schedule("1f1b"), m, 3)


def test_two_bw_and_wpipe_set_aside_the_versions_they_still_need():
    topo, m, steps = Topology(toy_plan("two-ranks")), 4, 3
    for name, stashing in [("2bw", {0, 1, 2, 3}), ("wpipe", {0, 1}), ("1f1b", set())]:
        sched = get_schedule(name)
        pols = sched.policies(topo.stage_infos(), m)
        kept = set()
        for acts in Timeline(sched, topo.stage_infos(), m, steps).lists().values():
            follow, dropped = Versions(pols, m, steps), set()
            for a in acts:  # a version is dropped only once no action uses it any more
                if a.kind == "S":
                    dropped.update(follow.step(a)[1])
                elif (key := follow.use(a)) is not None:
                    assert key not in dropped, (name, a)
                    kept.add(key[0])
            assert all(pols[s].weight_delay for s, _ in dropped), name
        assert kept == stashing, name


def test_receives_posted_ahead_are_bounded_in_count_as_well_as_bytes(monkeypatch):
    """Small messages must not fill the byte window with receives for the whole run (start-up
    would then grow with --steps): at most POST_AHEAD_MESSAGES wait per source, and taking
    one posts the next."""
    import torch
    from ftpipe_runtime.engine import comm as comm_mod

    topo = Topology(toy_plan("two-ranks"))
    flow = _flow(topo, get_schedule("1f1b"), 4, 100_000)
    monkeypatch.setattr(comm_mod.dist, "irecv", lambda buf, **kw: object())
    c = comm_mod.Comm(1, 2, "cpu", 5.0, flow, lambda key: ((2,), torch.float32))
    c.pair_groups[(0, 1)] = None
    c.post_ahead()
    assert len(c._posted) == comm_mod.POST_AHEAD_MESSAGES
    first = _keys_prefix(flow, 0, 1, comm_mod.POST_AHEAD_MESSAGES + 1)
    monkeypatch.setattr(c, "wait", lambda work, what: None)
    c.recv(0, first[0])
    assert len(c._posted) == comm_mod.POST_AHEAD_MESSAGES
    assert (0, first[-1]) in c._posted  # the next message's receive went up


class _GlooSend:
    """A gloo send as torch reports it: never complete until waited for."""

    def __init__(self):
        self.waited = False

    def is_completed(self) -> bool:
        return self.waited


@pytest.mark.parametrize("schedule", ["1f1b", "2bw"])
def test_sent_tensors_are_let_go_though_gloo_never_says_they_went(monkeypatch, schedule):
    """Gloo's isend reports completion only once waited for: the sender held every tensor it
    sent until the run's end. Under a synchronous schedule a rank's last step action of a step
    waits for every send so far (their receivers take them within the step); under an
    asynchronous one its first step action waits for the sends made before its previous one
    (their receivers took them in that step) and lets them go."""
    import torch
    from ftpipe_runtime.engine import comm as comm_mod

    topo = Topology(toy_plan("two-ranks"))  # two stages on rank 0: two step actions a step
    flow = _flow(topo, get_schedule(schedule), 4, 3)
    works = []
    monkeypatch.setattr(
        comm_mod.dist, "isend", lambda t, **kw: works.append(_GlooSend()) or works[-1]
    )
    c = comm_mod.Comm(0, 2, "cpu", 5.0, flow, lambda key: ((2,), torch.float32))
    c.pair_groups[(0, 1)] = None
    monkeypatch.setattr(c, "wait", lambda work, what: setattr(work, "waited", True))
    keys = iter(_keys_prefix(flow, 0, 1, 12))

    def send(n):
        for _ in range(n):
            c.send(1, next(keys), torch.ones(2))

    send(4)  # step 0
    c.settle(0)
    assert not any(w.waited for w in works) and len(c._sends) == 4
    c.settle(0)  # the rank's second stage's step
    if schedule == "1f1b":
        assert all(w.waited for w in works) and not c._sends  # the step's sends are taken
    else:
        assert not any(w.waited for w in works) and len(c._sends) == 4
    send(4)  # step 1
    c.settle(1)
    c.settle(1)
    if schedule == "1f1b":
        assert all(w.waited for w in works) and not c._sends
    else:
        assert [w.waited for w in works] == [True] * 4 + [False] * 4
        assert len(c._sends) == 4  # step 0's tensors let go
    send(1)
    c.finish()
    assert all(w.waited for w in works) and not c._sends


def _keys_prefix(flow, src, dst, n) -> list:
    stream = flow.keys(src, dst)
    return [stream.get(i) for i in range(n)]


@pytest.mark.parametrize("schedule", ["gpipe", "ftpipe", "2bw"])
def test_forward_versions_follow_the_owners_steps(schedule):
    """The version each forward of stage 0 reads and how many forwards read it, against a
    count of stage 0's steps before each of its forwards (or the pinned version)."""
    from ftpipe_runtime.schedules import ForwardVersions

    topo, m, steps = Topology(toy_plan("two-ranks")), 3, 4
    flow = _flow(topo, get_schedule(schedule), m, steps)
    acts, pol = flow.timeline.lists()[0], flow.policies[0]
    expected, taken = {}, 0
    for a in acts:
        taken += a.stage == 0 and a.kind == "S"
        if a.stage == 0 and a.kind == "F":
            pinned = pol.version(a.mb, m)
            expected[a.mb] = taken if pinned is None else pinned
    fv = ForwardVersions(acts, 0, pol, m)
    assert {mb: fv.version(mb) for mb in range(m * steps)} == expected
    counts = {v: list(expected.values()).count(v) for v in set(expected.values())}
    assert {v: fv.forwards(v) for v in counts} == counts
    with pytest.raises(ScheduleError, match="no forward of micro-batch"):
        fv.version(m * steps)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_a_synchronous_step_sends_its_new_weights_at_once(schedule):
    """The version a step makes leaves with that step (crossing while the owner runs its next
    forward), not after the owner's next forward; the first version goes with the first
    forward, and the run's last step sends nothing nobody reads. A backward sends the
    activations' gradients before a weight's, which the owner needs only at its end."""
    topo, m, steps = Topology(toy_plan("two-ranks")), 2, 3
    flow = _flow(topo, get_schedule(schedule), m, steps)
    items = list(flow.actions(0))
    weights = [(i.action, k) for i in items for _, k in i.sends if k[0] == "weight"]
    assert [(str(a), k[2]) for a, k in weights] == [("0F0", 0), ("2S0", 1), ("2S1", 2)]
    assert all(i.event is not None for i in items if i.sends and i.action.kind == "S")
    for item in flow.actions(1):
        kinds = [k[0] for _, k in item.sends]
        if "wgrad" in kinds:
            assert kinds[-1] == "wgrad" and "grad" in kinds, kinds


def test_an_asynchronous_step_leaves_its_weights_to_the_next_forward():
    topo, m, steps = Topology(toy_plan("two-ranks")), 2, 3
    flow = _flow(topo, get_schedule("ftpipe"), m, steps)
    sent_at = {i.action.kind for i in flow.actions(0) for _, k in i.sends if k[0] == "weight"}
    assert sent_at == {"F"}


@pytest.mark.parametrize("schedule", ["gpipe", "2bw"])
def test_evaluation_sends_a_tied_weight_once_per_round(schedule):
    """Issue 32: every evaluation batch sent (and copied) the tied embedding. A round sends it
    once, with its first batch; the activations go every batch."""
    from ftpipe_runtime.engine.evaluate import Rounds, eval_points

    topo = Topology(toy_plan("two-ranks"))  # emb.weight: stage 0 (rank 0) -> stage 3 (rank 1)
    m, steps, batches = 2, 4, 3
    timeline = Timeline(get_schedule(schedule), topo.stage_infos(), m, steps)
    rounds = Rounds(topo, m, batches, eval_points(steps, 0, 2), 0)  # after steps 2 and 4
    flow = Dataflow(topo, timeline, rounds)
    sent = [key for it in flow.actions(0) if it.action.kind == "E" for _, key in it.sends]
    assert [k for k in sent if k[1] == "emb.weight"] == [
        ("eval", "emb.weight", 0),
        ("eval", "emb.weight", 3),
    ]
    assert [k[2] for k in sent if k[1] == "x0"] == list(range(2 * batches))
    assert _keys(flow, 0, 1).count(("eval", "emb.weight", 1)) == 0


def test_an_asynchronous_round_sends_no_copy_of_what_its_readers_hold():
    """Under FTPipe a version of stage 0's weights straddles the step a round follows: rank
    1 holds the value the round would send (the version its next forward reads), so only
    the last round, after everything, sends the embedding."""
    from ftpipe_runtime.engine.evaluate import Rounds, eval_points

    topo = Topology(toy_plan("two-ranks"))
    m, steps, batches = 2, 6, 3
    timeline = Timeline(get_schedule("ftpipe"), topo.stage_infos(), m, steps)
    rounds = Rounds(topo, m, batches, eval_points(steps, 0, 2), 0)  # after steps 2, 4 and 6
    flow = Dataflow(topo, timeline, rounds)
    sent = [key for it in flow.actions(0) if it.action.kind == "E" for _, key in it.sends]
    assert [k for k in sent if k[1] == "emb.weight"] == [("eval", "emb.weight", 6)]
    assert [flow.eval_reads("emb.weight", r * batches) for r in range(3)] == [2 * m, 4 * m, None]
    for mb in (2 * m, 4 * m):
        assert flow.version("emb.weight", mb) == flow.version("emb.weight", mb - 1)
