"""Schedules: action strings, per-stage contents, and deadlock-freedom of the per-GPU lists."""

from __future__ import annotations

import random

import pytest
from ftpipe_runtime.schedules import (
    SCHEDULES,
    Action,
    StageInfo,
    actions,
    get_schedule,
)


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
    return stages, edges


def execute(lists, stages, edges, groups):
    """Run per-GPU lists strictly in order, each action waiting for its inputs; return the
    executed actions per stage, or fail on a deadlock."""
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


def test_action_strings_round_trip():
    for a in [
        Action("F", 3, 2),
        Action("B", 3, 2),
        Action("B", 3, 2, True),
        Action("S", 3, 1),
        Action("F", 12, 105),
    ]:
        assert Action.parse(str(a)) == a
    assert [
        str(a)
        for a in (Action("F", 3, 2), Action("B", 3, 2), Action("B", 3, 2, True), Action("S", 3, 1))
    ] == ["3F2", "3B2", "3R2", "3S1"]
    with pytest.raises(ValueError):
        Action.parse("3X2")
    with pytest.raises(ValueError):
        Action("F", 0, 0, recompute=True)


def test_unknown_schedule():
    with pytest.raises(ValueError, match="unknown schedule 'nope'; choose from gpipe"):
        get_schedule("nope")


@pytest.mark.parametrize("name", sorted(SCHEDULES))
@pytest.mark.parametrize("m,steps", [(1, 1), (3, 2), (4, 3), (8, 2)])
def test_every_stage_runs_each_micro_batch_once(name, m, steps):
    k = 4
    stages = [StageInfo(i, i, k - 1 - i, i == k - 1) for i in range(k)]
    sched = get_schedule(name)
    lists = actions(name, stages, m, steps)
    for st in stages:
        seq = lists[st.id]
        assert sorted(a.mb for a in seq if a.kind == "F") == list(range(m * steps))
        assert sorted(a.mb for a in seq if a.kind == "B") == list(range(m * steps))
        assert all(a.recompute == sched.recompute(st.is_last) for a in seq if a.kind == "B")
        # S after every M backwards of the stage, and nowhere else.
        backwards = 0
        for i, a in enumerate(seq):
            if a.kind == "B":
                backwards += 1
            elif a.kind == "S":
                assert backwards == m * (a.mb + 1) and seq[i - 1].kind == "B"
        assert [a.mb for a in seq if a.kind == "S"] == list(range(steps))
        # Every forward before its own backward.
        where = {(a.kind, a.mb): i for i, a in enumerate(seq)}
        assert all(where["F", mb] < where["B", mb] for mb in range(m * steps))


def held(seq):
    """Most micro-batches a stage holds between its F and its B."""
    n = peak = 0
    for a in seq:
        n += (a.kind == "F") - (a.kind == "B")
        peak = max(peak, n)
    return peak


@pytest.mark.parametrize("name", sorted(SCHEDULES))
def test_held_micro_batches_match_schedule_in_flight(name):
    k, m = 5, 3
    stages = [StageInfo(i, i, k - 1 - i, i == k - 1) for i in range(k)]
    lists = actions(name, stages, m, 4)
    for st in stages:
        assert held(lists[st.id]) == get_schedule(name).in_flight(st.depth, m)


def test_known_orders():
    stages = [StageInfo(0, 0, 1, False), StageInfo(1, 1, 0, True)]
    text = {
        n: {g: " ".join(map(str, seq)) for g, seq in actions(n, stages, 3, 1).items()}
        for n in SCHEDULES
    }
    assert text["gpipe"][0] == "0F0 0F1 0F2 0R2 0R1 0R0 0S0"
    assert text["1f1b"][0] == "0F0 0F1 0R0 0F2 0R1 0R2 0S0"
    assert text["1f1b"][1] == "1F0 1B0 1F1 1B1 1F2 1B2 1S0"
    assert text["gpipe"][1] == "1F0 1F1 1F2 1R2 1R1 1R0 1S0"
    # Async: one stream across steps, a step after each 3 backwards.
    assert (
        " ".join(map(str, actions("ftpipe", stages, 2, 2)[0]))
        == "0F0 0F1 0R0 0F2 0R1 0S0 0F3 0R2 0R3 0S1"
    )


def test_the_checker_catches_a_deadlock():
    stages = [StageInfo(0, 0, 1, False), StageInfo(1, 0, 0, True)]
    bad = {0: [Action.parse(a) for a in "1F0 0F0 0R0 1B0 0S0 1S0".split()]}
    with pytest.raises(AssertionError, match="deadlock at"):
        execute(bad, stages, {0: [1], 1: []}, ())


@pytest.mark.parametrize("layout", range(60))
def test_random_multi_stage_layouts_never_deadlock(seed, layout):
    rng = random.Random(seed * 1000 + layout)
    stages, edges = random_layout(rng)
    m, steps = rng.randint(1, 4), rng.randint(1, 3)
    for name in SCHEDULES:
        lists = actions(name, stages, m, steps)
        ran = execute(lists, stages, edges, get_schedule(name).step_groups(stages))
        # Interleaving keeps each stage's own order: the per-stage lists are unchanged.
        for st in stages:
            assert ran[st.id] == get_schedule(name).stage_actions(st, m, steps)


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
def test_synchronous_schedules_flush_each_gpu_before_its_steps(name):
    # Folded: stages i and 7 - i share a GPU, so one stage finishes a step long before the other.
    stages = [StageInfo(i, min(i, 7 - i), 7 - i, i == 7) for i in range(8)]
    m = 3
    for seq in actions(name, stages, m, 3).values():
        for i, a in enumerate(seq):
            step = a.mb if a.kind == "S" else a.mb // m
            before = {b.mb if b.kind == "S" else b.mb // m for b in seq[:i]}
            assert max(before, default=0) <= step  # nothing of a later step runs earlier
        kinds = "".join("S" if a.kind == "S" else "x" for a in seq)
        assert kinds.count("SS") == 3 and "SxS" not in kinds  # a GPU's two S of a step adjacent


def test_asynchronous_stages_step_alone():
    """Under ftpipe no optimizer step waits for another stage's: a weight read by several
    stages travels with the micro-batches instead of being summed at a shared step."""
    stages = [StageInfo(i, min(i, 7 - i), 7 - i, i == 7) for i in range(8)]
    assert get_schedule("ftpipe").step_groups(stages) == ()
    assert get_schedule("gpipe").step_groups(stages) == (tuple(range(8)),)
    lists = actions("ftpipe", stages, 4, 3)
    for st in stages:  # each S right where its own stage list puts it: after its 4th backward
        mine = [a for a in lists[st.gpu] if a.stage == st.id]
        assert mine == get_schedule("ftpipe").stage_actions(st, 4, 3)
