"""Schedules: action strings, per-stage contents, memory statements, and deadlock-freedom."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
from ftpipe_runtime.schedules import (
    KINDS,
    SCHEDULES,
    Action,
    ScheduleError,
    StageGraph,
    StageInfo,
    actions,
    get_schedule,
    validate,
    weight_plan,
    with_chunks,
)
from ftpipe_runtime.schedules.base import flushed

from ftpipe_compiler.costs.formulas import weight_copies


def assumed_graph(stages) -> StageGraph:
    """Edges unknown: every lower-id stage of greater depth feeds every later one."""
    consumers = {
        s.id: tuple(c.id for c in stages if c.id > s.id and c.depth < s.depth) for s in stages
    }
    return StageGraph.of(stages, consumers)


FREE = [n for n, s in SCHEDULES.items() if s.placement.free]


def chain(k: int, gpu_of=None) -> list[StageInfo]:
    gpu_of = gpu_of or list(range(k))
    return with_chunks(StageInfo(i, gpu_of[i], k - 1 - i, i == k - 1) for i in range(k))


def layout_for(name: str, gpus: int) -> list[StageInfo]:
    """A chain in the schedule's placement: one stage per GPU, or its pattern."""
    placement = get_schedule(name).placement
    return chain(gpus) if placement.free else placement.chain(gpus)


def random_layout(rng: random.Random):
    """A random stage DAG (ids topological, one loss stage every stage reaches), its depths
    computed as build_plan does, and a random GPU per stage (several stages per GPU)."""
    n = rng.randint(2, 9)
    edges = {
        i: sorted(rng.sample(range(i + 1, n), min(n - i - 1, rng.randint(1, 2))))
        for i in range(n - 1)
    }
    edges[n - 1] = []
    depth = {}
    for i in reversed(range(n)):
        depth[i] = max((depth[j] + 1 for j in edges[i]), default=0)
    gpus = rng.randint(1, n)
    stages = [StageInfo(i, rng.randrange(gpus), depth[i], i == n - 1) for i in range(n)]
    return with_chunks(stages), edges


def execute(lists, stages, edges, groups):
    """Run per-GPU lists strictly in order, each action waiting for its inputs; return the
    executed actions per stage, or fail on a deadlock. Written apart from `validate`."""
    producers = {s.id: [p for p, cs in edges.items() if s.id in cs] for s in stages}
    group_of = {s: g for g in groups for s in g}
    gpu_of = {s.id: s.gpu for s in stages}
    done: set[tuple] = set()
    pos = dict.fromkeys(lists, 0)
    ran = {s.id: [] for s in stages}

    def head(g):
        return lists[g][pos[g]] if pos[g] < len(lists[g]) else None

    def run(g):
        a = head(g)
        done.add((a.kind, a.stage, a.mb))
        ran[a.stage].append(a)
        pos[g] += 1

    while any(head(g) for g in lists):
        moved = False
        for g in lists:
            a = head(g)
            if a is None:
                continue
            if a.kind == "F":
                ok = all(("F", p, a.mb) in done for p in producers[a.stage])
            elif a.kind == "B":
                ok = ("F", a.stage, a.mb) in done and all(
                    ("B", c, a.mb) in done for c in edges[a.stage]
                )
            elif a.kind == "W":
                ok = ("B", a.stage, a.mb) in done
            else:
                group = group_of.get(a.stage, (a.stage,))
                hosts = {gpu_of[s] for s in group}
                ok = all(
                    (h := head(x)) and h.kind == "S" and h.mb == a.mb and h.stage in group
                    for x in hosts
                )
                if ok:  # the whole group steps at once; its S actions are adjacent per GPU
                    for x in hosts:
                        while (
                            (h := head(x)) and h.kind == "S" and h.mb == a.mb and h.stage in group
                        ):
                            run(x)
                    assert all(("S", s, a.mb) in done for s in group), (
                        "a synchronised step was split"
                    )
                    moved = True
                    continue
            if ok:
                run(g)
                moved = True
        assert moved, f"deadlock at {[str(head(g)) for g in lists if head(g)]}"
    return ran


def _acts(text: str) -> list[Action]:
    return [Action.parse(a) for a in text.split()]


def test_action_strings_round_trip():
    for a in [
        Action("F", 3, 2),
        Action("B", 3, 2),
        Action("B", 3, 2, True),
        Action("S", 3, 1),
        Action("W", 3, 2),
        Action("F", 12, 105),
    ]:
        assert Action.parse(str(a)) == a
    assert [
        str(a)
        for a in (Action("F", 3, 2), Action("B", 3, 2), Action("B", 3, 2, True), Action("S", 3, 1))
    ] == ["3F2", "3B2", "3R2", "3S1"]
    assert {Action.parse(f"1{k}0").kind for k in KINDS} == set(KINDS)
    with pytest.raises(
        ValueError, match="not an action: '3X2'; write e.g. 3F2, 3B2, 3W2, 3S2, 3E2, 3R2"
    ):
        Action.parse("3X2")
    with pytest.raises(ValueError):
        Action("F", 0, 0, recompute=True)


def test_unknown_schedule():
    with pytest.raises(ValueError, match="unknown schedule 'nope'; choose from gpipe"):
        get_schedule("nope")


@pytest.mark.parametrize("name", sorted(SCHEDULES))
@pytest.mark.parametrize("m,steps", [(4, 1), (4, 3), (5, 2), (8, 2)])
def test_every_stage_runs_each_micro_batch_once(name, m, steps):
    sched = get_schedule(name)
    stages = layout_for(name, 4)
    lists = actions(name, stages, m, steps)
    policies = sched.policies(stages, m)
    for st in stages:
        seq = [a for a in lists[st.gpu] if a.stage == st.id]
        split = policies[st.id].split
        assert sorted(a.mb for a in seq if a.kind == "F") == list(range(m * steps))
        assert sorted(a.mb for a in seq if a.kind == "B") == list(range(m * steps))
        # A weight pass per micro-batch exactly when the schedule splits the backward.
        assert sorted(a.mb for a in seq if a.kind == "W") == list(range(m * steps) if split else [])
        assert all(a.recompute == policies[st.id].recompute for a in seq if a.kind == "B")
        # S after every M backwards (W's when split) of the stage, and nowhere else.
        closing = "W" if split else "B"
        backwards = 0
        for i, a in enumerate(seq):
            if a.kind == closing:
                backwards += 1
            elif a.kind == "S":
                assert backwards == m * (a.mb + 1) and seq[i - 1].kind == closing
        assert [a.mb for a in seq if a.kind == "S"] == list(range(steps))
        where = {(a.kind, a.mb): i for i, a in enumerate(seq)}
        assert all(where["F", mb] < where["B", mb] for mb in range(m * steps))
        assert all(where["B", mb] < where["W", mb] for mb in range(m * steps) if split)
    validate(lists, assumed_graph(stages), sched, m, steps)


def held(seq):
    """Most micro-batches a stage holds between its F and its B (its W when split), and most
    between its B and its W."""
    split = any(a.kind == "W" for a in seq)
    n = peak = wait = most = 0
    for a in seq:
        n += (a.kind == "F") - (a.kind == ("W" if split else "B"))
        wait += (a.kind == "B" and split) - (a.kind == "W")
        peak, most = max(peak, n), max(most, wait)
    return peak, most


@pytest.mark.parametrize("name", sorted(SCHEDULES))
def test_held_micro_batches_match_the_stated_policy(name):
    m = 5
    stages = layout_for(name, 5)
    lists = actions(name, stages, m, 4)
    policies = get_schedule(name).policies(stages, m)
    for st in stages:
        seq = [a for a in lists[st.gpu] if a.stage == st.id]
        pol = policies[st.id]
        assert held(seq) == (pol.in_flight, pol.deferred if pol.split else 0), st


def test_in_flight_and_versions_by_schedule():
    """What each schedule states: GPipe holds m, 1F1B and 2BW min(m, depth + 1), FTPipe
    depth + 1; 2BW keeps two versions at delay 1; WPipe's G0 two, its G1 one."""
    k, m = 4, 6
    stages = chain(k)
    for name, held_of, versions, delay in [
        ("gpipe", lambda st: m, 1, 0),
        ("1f1b", lambda st: min(m, st.depth + 1), 1, 0),
        ("ftpipe", lambda st: st.depth + 1, 1, None),
        ("2bw", lambda st: min(m, st.depth + 1), 2, 1),
    ]:
        for st in stages:
            pol = get_schedule(name).policy(st, m, k)
            assert (pol.in_flight, pol.weight_versions, pol.weight_delay) == (
                held_of(st),
                versions,
                delay,
            ), name
            assert pol.recompute == (not st.is_last)
    looped = get_schedule("wpipe").placement.chain(k)
    assert [(s.id, s.gpu, s.chunk) for s in looped] == [(p, p % k, p // k) for p in range(2 * k)]
    pols = get_schedule("wpipe").policies(looped, m)
    assert [pols[p].in_flight for p in range(2 * k)] == [m + min(m, k - i) for i in range(k)] + [
        min(m, k - i) for i in range(k)
    ]
    assert [pols[p].weight_versions for p in range(2 * k)] == [2] * k + [1] * k
    assert [pols[p].weight_delay for p in range(2 * k)] == [1] * k + [0] * k


@pytest.mark.parametrize("name", sorted(SCHEDULES))
def test_weight_versions_alive_match_the_policy(name):
    m, k = 4, 3
    stages = layout_for(name, k)
    lists = actions(name, stages, m, 4)
    pols = get_schedule(name).policies(stages, m)
    for acts in lists.values():
        plan = weight_plan(acts, pols, m)
        for s, most in plan.most.items():
            assert most == pols[s].weight_versions, (name, s)


@pytest.mark.parametrize(
    "name,recompute",
    [(n, True) for n in sorted(SCHEDULES)]
    + [(n, False) for n in sorted(SCHEDULES) if get_schedule(n).can_keep_activations],
)
def test_the_plan_counts_the_weight_copies_the_runtime_holds(name, recompute):
    """`formulas.weight_copies` (the plan's memory) is the most copies of a stage's weights
    the executor holds at once: the live ones and the versions set aside. A recomputing
    2BW stage holds the paper's two (until 2026-11-30 it set the version the next step's
    first forward read aside then, a third copy until the step); one keeping its graphs, three."""
    m, k = 4, 3
    stages = layout_for(name, k)
    schedule = get_schedule(name)
    schedule = schedule if recompute else schedule.without_recompute()
    pols = schedule.policies(stages, m)
    for acts in schedule.actions(stages, m, 4).values():
        for s, held in weight_plan(acts, pols, m).copies.items():
            assert held <= weight_copies(pols[s]), (name, s, held)
            if pols[s].weight_delay and pols[s].in_flight > 1:
                assert held == weight_copies(pols[s]), (name, s, held)


def test_two_bw_runs_step_k_on_the_weights_after_k_minus_1_steps():
    m, stages = 4, chain(3)
    lists = actions("2bw", stages, m, 4)
    pols = get_schedule("2bw").policies(stages, m)
    for acts in lists.values():
        plan = weight_plan(acts, pols, m)
        assert all(v == max(mb // m - 1, 0) for (_, mb), v in plan.version.items())
        # Steps of a stage come after forwards of the next step began: a shadow is needed.
        assert plan.stashed


def test_known_orders():
    stages = chain(2)
    text = {
        n: {g: " ".join(map(str, seq)) for g, seq in actions(n, stages, 3, 1).items()} for n in FREE
    }
    assert text["gpipe"][0] == "0F0 0F1 0F2 0R2 0R1 0R0 0S0"
    assert text["1f1b"][0] == "0F0 0F1 0R0 0F2 0R1 0R2 0S0"
    assert text["1f1b"][1] == "1F0 1B0 1F1 1B1 1F2 1B2 1S0"
    assert text["gpipe"][1] == "1F0 1F1 1F2 1B2 1B1 1B0 1S0"  # the loss stage keeps its graphs
    # Async and 2BW: one stream across steps, a step after each 2 backwards.
    for name in ("ftpipe", "2bw"):
        assert (
            " ".join(map(str, actions(name, stages, 2, 2)[0]))
            == "0F0 0F1 0R0 0F2 0R1 0S0 0F3 0R2 0R3 0S1"
        )
    # WPipe on 2 GPUs: G0 (stage 0) forwards step 1 before its backwards of step 0.
    wp = actions("wpipe", get_schedule("wpipe").placement.chain(2), 2, 2)
    g0 = " ".join(str(a) for a in wp[0] if a.stage == 0)
    assert g0 == "0F0 0F1 0F2 0F3 0R0 0R1 0S0 0R2 0R3 0S1"
    g1 = " ".join(str(a) for a in wp[0] if a.stage == 2)
    assert g1 == "2F0 2F1 2R0 2R1 2S0 2F2 2F3 2R2 2R3 2S1"


def test_wpipe_needs_its_placement_and_enough_micro_batches():
    with pytest.raises(ScheduleError, match="wpipe needs 4 stages placed in a loop"):
        actions("wpipe", chain(2), 4, 1)
    with pytest.raises(ScheduleError, match="wpipe needs at least 3 micro-batches"):
        actions("wpipe", get_schedule("wpipe").placement.chain(3), 2, 1)


def _stuck(lists, stages, name, m=1, steps=1, graph=None):
    sched = get_schedule(name)
    with pytest.raises(ScheduleError) as e:
        validate(lists, graph or assumed_graph(stages), sched, m, steps)
    return str(e.value)


def test_the_validator_names_what_is_wrong():
    stages = chain(2, [0, 1])
    good = {0: _acts("0F0 0R0 0S0"), 1: _acts("1F0 1B0 1S0")}
    validate(good, assumed_graph(stages), get_schedule("1f1b"), 1, 1)
    cases = {
        "1F0 is missing: stage 1 never runs its forward of micro-batch 0": {
            0: _acts("0F0 0R0 0S0"),
            1: _acts("1B0 1S0"),
        },
        "1B0 appears twice": {0: _acts("0F0 0R0 0S0"), 1: _acts("1F0 1B0 1B0 1S0")},
        "0F0 is on GPU 1, but stage 0 is on GPU 0": {0: _acts("0R0 0S0"), 1: _acts("0F0 1F0")},
        "1B0 comes before 1F0 on GPU 1": {0: _acts("0F0 0R0 0S0"), 1: _acts("1B0 1F0 1S0")},
        "0S0 on GPU 0 does not follow exactly the 1 backwards of step 0": {
            0: _acts("0F0 0S0 0R0"),
            1: _acts("1F0 1B0 1S0"),
        },
        "0F1 on GPU 0 is outside micro-batches 0..0": {
            0: _acts("0F0 0F1 0R0 0S0"),
            1: _acts("1F0 1B0 1S0"),
        },
        "0B0 on GPU 0: stage 0 recomputes under this schedule": {
            0: _acts("0F0 0B0 0S0"),
            1: _acts("1F0 1B0 1S0"),
        },
    }
    for message, lists in cases.items():
        assert message in _stuck(lists, stages, "1f1b"), message


def test_a_deadlock_is_refused_naming_where_each_gpu_waits():
    stages = [StageInfo(i, g, 3 - i, i == 3) for i, g in enumerate([0, 1, 0, 1])]
    graph = StageGraph.of(stages, {0: (1,), 1: (2,), 2: (3,)})
    # GPU 0 wants stage 2's forward (needs stage 1's) before it made stage 0's for GPU 1.
    lists = {0: _acts("2F0 0F0 2R0 0R0 0S0 2S0"), 1: _acts("1F0 3F0 3B0 1R0 1S0 3S0")}
    msg = _stuck(lists, stages, "1f1b", graph=graph)
    assert msg == (
        "these action lists deadlock: GPU 0 at 2F0 waits for 1F0; GPU 1 at 1F0 waits for 0F0"
    )
    # On one GPU: a forward before the one it needs from its own list.
    lists = {0: _acts("1F0 0F0 0R0 1B0 0S0 1S0")}
    one = [StageInfo(0, 0, 1, False), StageInfo(1, 0, 0, True, 1)]
    assert "1F0 comes before 0F0 on GPU 0, and needs it" in _stuck(lists, one, "1f1b")


def test_more_in_flight_or_versions_than_stated_is_refused():
    stages = chain(2)
    # 1F1B's stage 0 holds at most min(m, 2) = 2; three forwards ahead is GPipe's memory.
    lists = actions("gpipe", stages, 3, 1)
    lists = {g: [Action(a.kind, a.stage, a.mb, a.recompute and a.stage == 0) for a in acts]
             for g, acts in lists.items()}  # fmt: skip
    assert "stage 0 would hold 3 micro-batches, the schedule's memory model allows 2" in _stuck(
        lists, stages, "1f1b", m=3
    )
    # 2BW's order starts step 1 before step 0 ends: plain SGD has no such weights yet.
    lists = actions("2bw", stages, 2, 2)
    assert "0F2 needs the weights of stage 0 after 1 of its steps, but it has taken 0" in _stuck(
        lists, stages, "1f1b", m=2, steps=2
    )
    # ... and with the 1-stale rule but one copy of the weights, the shadow has no room.
    two_bw = get_schedule("2bw")
    one_copy = replace(
        two_bw, policy_of=lambda st, m, g: replace(two_bw.policy(st, m, g), weight_versions=1)
    )
    with pytest.raises(ScheduleError, match="stage 0 would keep 2 versions of its weights"):
        validate(lists, assumed_graph(stages), one_copy, 2, 2)


def test_a_synchronous_gpu_finishes_a_step_before_the_next():
    # Stage 0 starts step 1 on GPU 0 before stage 2 there has taken step 0: at that step the
    # GPU updates both stages at once (one gradient norm), after 0F1 ran on old weights.
    stages = [StageInfo(0, 0, 2, False), StageInfo(1, 1, 1, False), StageInfo(2, 0, 0, True, 1)]
    lists = {
        0: _acts("0F0 2F0 2B0 0R0 0S0 0F1 2S0 2F1 2B1 0R1 0S1 2S1"),
        1: _acts("1F0 1R0 1S0 1F1 1R1 1S1"),
    }
    assert "GPU 0 starts step 1 before 2S0" in _stuck(lists, stages, "1f1b", m=1, steps=2)


def test_an_unpinned_stage_keeps_no_graph_across_its_own_step():
    """FTPipe's rule reads the newest weights: a kept graph across a step would be stale."""
    stages = chain(2)
    ftpipe = get_schedule("ftpipe")
    deeper = replace(
        ftpipe, policy_of=lambda st, m, g: replace(ftpipe.policy(st, m, g), in_flight=2)
    )
    lists = {
        0: _acts("0F0 0F1 0R0 0F2 0R1 0S0 0F3 0R2 0R3 0S1"),
        1: _acts("1F0 1F1 1B0 1B1 1S0 1F2 1F3 1B2 1B3 1S1"),
    }
    validate(lists, assumed_graph(stages), deeper, 2, 2)
    lists[1] = _acts("1F0 1F1 1B0 1F2 1B1 1S0 1B2 1F3 1B3 1S1")
    with pytest.raises(ScheduleError, match="stage 1 steps between 1F2 and 1B2 without recomp"):
        validate(lists, assumed_graph(stages), deeper, 2, 2)


@pytest.mark.parametrize("layout", range(60))
def test_random_multi_stage_layouts_never_deadlock(seed, layout):
    rng = random.Random(seed * 1000 + layout)
    stages, edges = random_layout(rng)
    m, steps = rng.randint(1, 4), rng.randint(1, 3)
    graph = StageGraph.of(stages, {s: tuple(cs) for s, cs in edges.items()})
    for name in FREE:
        sched = get_schedule(name)
        lists = actions(name, stages, m, steps)
        ran = execute(lists, stages, edges, sched.step_groups(stages))
        validate(lists, graph, sched, m, steps)
        # Interleaving keeps each stage's own order: the per-stage lists are unchanged.
        gpus = max(s.gpu for s in stages) + 1
        for st in stages if sched.stream else ():
            assert ran[st.id] == sched.stage_actions(st, m, steps, gpus)


@pytest.mark.parametrize("gpus,m", [(2, 2), (3, 4), (4, 4), (4, 7), (8, 10)])
def test_wpipe_lists_run_on_the_looped_chain(gpus, m):
    """G1 keeps its 1F1B order; G0 forwards in order, backwards in order, and its forwards
    of step k + 1 come before its backwards of step k end (one step ahead, §3.2)."""
    sched = get_schedule("wpipe")
    stages = sched.placement.chain(gpus)
    edges = {s.id: ([s.id + 1] if s.id + 1 < 2 * gpus else []) for s in stages}
    lists = actions("wpipe", stages, m, 3)
    ran = execute(lists, stages, edges, ())
    pols = sched.policies(stages, m)
    for st in stages:
        if st.chunk:
            assert ran[st.id] == flushed(st, pols[st.id], m, 3)
            continue
        mine = ran[st.id]
        for kind in "FB":
            assert [a.mb for a in mine if a.kind == kind] == list(range(3 * m))
        where = {str(a): i for i, a in enumerate(mine)}
        assert where[f"{st.id}F{m}"] < where[f"{st.id}S0"]  # step 1 starts before step 0 ends
    validate(lists, StageGraph.of(stages, {s: tuple(c) for s, c in edges.items()}), sched, m, 3)


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
def test_synchronous_schedules_flush_each_gpu_before_its_steps(name):
    # Folded: stages i and 7 - i share a GPU, so one stage finishes a step long before the other.
    stages = with_chunks(StageInfo(i, min(i, 7 - i), 7 - i, i == 7) for i in range(8))
    m = 3
    for seq in actions(name, stages, m, 3).values():
        for i, a in enumerate(seq):
            step = a.mb if a.kind == "S" else a.mb // m
            before = {b.mb if b.kind == "S" else b.mb // m for b in seq[:i]}
            assert max(before, default=0) <= step  # nothing of a later step runs earlier
        kinds = "".join("S" if a.kind == "S" else "x" for a in seq)
        assert kinds.count("SS") == 3 and "SxS" not in kinds  # a GPU's two S of a step adjacent


@pytest.mark.parametrize("name", ["ftpipe", "2bw"])
def test_asynchronous_stages_step_alone(name):
    """No optimizer step waits for another stage's: a weight read by several stages travels
    with the micro-batches instead of being summed at a shared step."""
    stages = with_chunks(StageInfo(i, min(i, 7 - i), 7 - i, i == 7) for i in range(8))
    sched = get_schedule(name)
    assert sched.step_groups(stages) == ()
    assert get_schedule("gpipe").step_groups(stages) == (tuple(range(8)),)
    lists = actions(name, stages, 4, 3)
    for st in stages:  # each S right where its own stage list puts it: after its 4th backward
        mine = [a for a in lists[st.gpu] if a.stage == st.id]
        assert mine == sched.stage_actions(st, 4, 3, 4)
