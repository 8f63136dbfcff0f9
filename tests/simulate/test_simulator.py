"""The simulator against closed forms: GPipe's bubble, 1F1B's in-flight count, the async
period, link serialisation, weights sent between stages, and the memory model."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
from ftpipe_runtime.schedules import get_schedule

from ftpipe_compiler.errors import FtpipeError
from ftpipe_compiler.simulate import SimResult, simulate, steady_steps


@pytest.mark.parametrize("k", [2, 4, 8])
@pytest.mark.parametrize("m", [1, 4, 8, 16])
def test_gpipe_bubble_is_k_minus_1_over_m_plus_k_minus_1(plan_factory, k, m):
    # Recompute costs nothing here, so every stage's backward takes 3 s whether it recomputes
    # or not (the loss stage does not): the stages are equal, as the formula assumes.
    plan = plan_factory([(1.0, 3.0, 0.0)] * k, schedule="gpipe", micro_batches=m)
    one_step = simulate(plan, steps=1)  # the whole step, flush included
    assert one_step.bubble_fraction == pytest.approx((k - 1) / (m + k - 1), rel=0.01)
    # Every step after it flushes the same way.
    steady = simulate(plan, steps=4)
    assert steady.step_time_s == pytest.approx((m + k - 1) * 4.0, rel=0.01)


@pytest.mark.parametrize("m", [2, 4, 10])
def test_1f1b_holds_min_m_and_k_minus_i_micro_batches(plan_factory, m):
    k = 6
    result = simulate(
        plan_factory([(1.0, 2.0, 1.0)] * k, schedule="1f1b", micro_batches=m), steps=3
    )
    assert result.in_flight == tuple(min(m, k - i) for i in range(k))


@pytest.mark.parametrize("trial", range(12))
def test_async_steady_state_runs_at_the_slowest_gpu_period(plan_factory, seed, trial):
    rng = random.Random(seed + trial)
    k, m = rng.randint(2, 8), rng.randint(1, 12)
    costs = [(rng.uniform(0.5, 2), rng.uniform(1, 4), rng.uniform(0.5, 2)) for _ in range(k)]
    # An embedding tied to the loss stage's head, as in T5 and GPT-2: it steps on its own.
    plan = plan_factory(costs, micro_batches=m, tied=[(0, k - 1)] if trial % 2 else ())
    result = simulate(plan, steps=10)
    assert result.step_time_s == pytest.approx(plan.period_s * m, rel=0.01)
    slowest = max(range(k), key=plan.gpu_compute_s)
    assert result.gpus[slowest].busy_fraction == pytest.approx(1.0, rel=0.01)
    # Transfers overlap compute but add latency that depth + 1 micro-batches in flight do not
    # always cover: never faster than the period, sometimes slower.
    slow = simulate(
        plan.with_(
            transfers=tuple(t.__class__(**{**t.__dict__, "bytes": 5e8}) for t in plan.transfers)
        ),
        steps=10,
    )
    assert slow.step_time_s >= plan.period_s * m * (1 - 1e-9)


def test_folded_pipeline_keeps_the_period(plan_factory):
    """Mixed-pipe style: 8 equal stages folded on 4 GPUs (stage i and 7 - i share a GPU)."""
    plan = plan_factory([(1.0, 2.0, 1.0)] * 8, gpu_of=[0, 1, 2, 3, 3, 2, 1, 0], micro_batches=8)
    result = simulate(plan, steps=10)
    assert result.step_time_s == pytest.approx(plan.period_s * 8, rel=0.01)


def test_a_directed_link_sends_one_tensor_at_a_time(plan_factory):
    # GPipe, 4 micro-batches, 10 s per activation or gradient on a link, little compute.
    plan = plan_factory(
        [(0.25, 0.5, 0.25), (0.5, 0.5, 0.0)],
        nbytes=10e9,
        bandwidth=1e9,
        schedule="gpipe",
        micro_batches=4,
    )
    result = simulate(plan, steps=1)
    # Activations leave GPU 0 back to back (F0 ends at 0.25, the 4th arrives at 40.25); GPU 1
    # runs F3 and B3 (41.25), then the 4 gradients queue on the link back (81.25), then
    # GPU 0's last recompute + backward (0.75 s). Links in parallel would give 53.5 s.
    assert result.step_time_s == pytest.approx(0.25 + 4 * 10 + 1.0 + 4 * 10 + 0.75)
    assert result.gpus[0].bytes_sent == 4 * 10e9  # activations
    assert result.gpus[1].bytes_sent == 4 * 10e9  # gradients


def test_a_tensor_goes_once_per_destination_gpu(plan_factory):
    # Stage 0 feeds stages 1 and 2, both on GPU 1: one copy crosses, one summed gradient returns.
    plan = plan_factory(
        [(1.0, 1.0, 1.0)] * 4,
        gpu_of=[0, 1, 1, 2],
        edges={0: [1, 2], 1: [3], 2: [3]},
        nbytes=1000,
        micro_batches=3,
    )
    result = simulate(plan, steps=2)
    assert result.gpus[0].bytes_sent == 3 * 1000
    assert result.gpus[1].bytes_sent == 3 * 1000 + 3 * 2 * 1000  # gradient to 0; 1, 2 -> 3
    assert result.gpus[2].bytes_sent == 3 * 2 * 1000  # two gradients back to GPU 1


def test_stages_on_one_gpu_hand_over_for_free(plan_factory):
    plan = plan_factory([(1.0, 2.0, 1.0)] * 2, gpu_of=[0, 0], nbytes=1e15, micro_batches=4)
    result = simulate(plan, steps=4)
    assert result.step_time_s == pytest.approx(4 * plan.gpu_compute_s(0), rel=1e-9)
    assert result.gpus[0].bytes_sent == 0


@pytest.mark.parametrize("schedule", ["gpipe", "ftpipe", "2bw"])
def test_a_weight_read_by_two_stages_travels_once_per_version(plan_factory, schedule):
    """Stage 0 owns a weight stage 2 reads: 500 bytes out once per version of stage 0's
    weights (it steps once per step, asynchronous or not), its gradient summed over the step
    back once, both hidden behind stage 1's compute; no all-reduce and no shared step."""
    kw = dict(schedule=schedule, micro_batches=4, bandwidth=1000.0)
    plain = simulate(plan_factory([(1.0, 2.0, 1.0)] * 3, **kw), steps=3)
    tied = simulate(
        plan_factory([(1.0, 2.0, 1.0)] * 3, tied=[(0, 2)], tied_bytes=500, **kw), steps=3
    )
    assert tied.step_time_s == pytest.approx(plain.step_time_s, rel=1e-9)
    # Per step of the steady state (2BW runs steps 0 and 1 on version 0: its step 1 sends
    # no weight, and is no step of the measured window).
    assert tied.gpus[0].bytes_sent == plain.gpus[0].bytes_sent + 500  # per step
    assert tied.gpus[2].bytes_sent == plain.gpus[2].bytes_sent + 500  # its gradient
    # As before weights went once per version: with each micro-batch, and each gradient back.
    each = simulate(
        plan_factory([(1.0, 2.0, 1.0)] * 3, tied=[(0, 2)], tied_bytes=500, **kw),
        steps=3,
        weights_once=False,
    )
    assert each.gpus[0].bytes_sent == plain.gpus[0].bytes_sent + 4 * 500
    assert each.gpus[2].bytes_sent == plain.gpus[2].bytes_sent + 4 * 500
    # Same GPU: handed over in place, nothing on the links.
    local = simulate(
        plan_factory([(1.0, 2.0, 1.0)] * 3, gpu_of=[0, 1, 0], tied=[(0, 2)], **kw), steps=3
    )
    assert local.gpus[0].bytes_sent == plain.gpus[0].bytes_sent


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "ftpipe", "2bw", "zb1p"])
def test_bytes_per_step_do_not_depend_on_the_steps_simulated(plan_factory, schedule):
    """Bytes per step are those of the measured (steady) steps: `ftpipe compile` (20 steps)
    and `ftpipe simulate` (10) say the same of one plan. Before, the bytes of every step run
    (warm-up, and an asynchronous pipeline's extra steps) were averaged: under 2BW, whose
    tied weight goes once per version from step 2 on, GPU 0 sent 4,375 bytes per step over 3
    steps and 4,455 over 10, where a steady step sends 4,500."""
    plan = plan_factory([(1.0, 2.0, 1.0)] * 3, nbytes=1000, tied=[(0, 2)], tied_bytes=500,
                        schedule=schedule, micro_batches=4)  # fmt: skip
    sent = {n: [g.bytes_sent for g in simulate(plan, steps=n).gpus] for n in (3, 10, 20)}
    assert sent[3] == sent[10] == sent[20] == [4 * 1000 + 500, 4 * 2 * 1000, 4 * 1000 + 500]


def test_memory_is_the_plan_memory_model_with_the_schedule_in_flight(plan_factory):
    plan = plan_factory([(1.0, 2.0, 1.0)] * 5, gpu_of=[0, 1, 2, 1, 0], micro_batches=3)
    for name in ("gpipe", "1f1b", "ftpipe", "2bw"):
        result = simulate(plan, name, steps=3)
        # What the schedule promises: its recompute rule and its in-flight count per stage.
        pols = get_schedule(name).policies(plan.stage_infos(), 3)
        planned = plan.with_(
            schedule=name,
            stages=tuple(replace(s, recompute=pols[s.id].recompute) for s in plan.stages),
        )
        assert result.in_flight == tuple(pols[s.id].in_flight for s in plan.stages)
        assert [g.peak_memory_bytes for g in result.gpus] == [
            planned.gpu_memory(g) for g in range(plan.gpus)
        ]


def test_other_schedule_recomputes_per_that_schedule(plan_factory):
    # The plan's flags say nobody recomputes; under gpipe all but the loss stage do.
    plan = plan_factory([(1.0, 2.0, 1.0)] * 3, schedule="ftpipe", micro_batches=2)
    plan = plan.with_(stages=tuple(replace(s, recompute=False) for s in plan.stages))
    result = simulate(plan, "gpipe", steps=1)
    # Forwards end at 4; the loss stage's backwards (2 s each, no recompute) at 8; stage 1
    # recomputes and backpropagates (3 s each) micro-batch 1 from 6 to 9 and 0 until 12;
    # stage 0 the same 3 s later: 15.
    assert result.step_time_s == pytest.approx(15.0)
    kinds = {
        s: {e.kind for e in result.timeline if e.stage == s and e.kind in "BR"} for s in (0, 2)
    }
    assert kinds == {0: {"R"}, 2: {"B"}}


@pytest.mark.parametrize("schedule", ["ftpipe", "1f1b", "gpipe"])
def test_a_forward_that_keeps_its_graph_takes_the_recording_time(plan_factory, schedule):
    """F of a stage that keeps its graph records it (recompute_s: a forward with autograd,
    measured slower than one without); F of a recomputing stage does not, its B redoes it."""
    plan = plan_factory([(1.0, 2.0, 1.5)] * 2, schedule=schedule, micro_batches=4)
    result = simulate(plan, steps=3)
    policies = get_schedule(schedule).policies(plan.stage_infos(), plan.micro_batches)
    for s in (0, 1):
        recomputes = policies[s].recompute
        f = {round(e.end - e.start, 9) for e in result.timeline if e.stage == s and e.kind == "F"}
        b = {round(e.end - e.start, 9) for e in result.timeline if e.stage == s and e.kind in "BR"}
        assert f == ({1.0} if recomputes else {1.5})
        assert b == ({3.5} if recomputes else {2.0})
        assert plan.stages[s].work_s(recomputes) == pytest.approx(4.5 if recomputes else 3.5)


def test_step_and_throughput_figures(plan_factory):
    plan = plan_factory([(1.0, 2.0, 1.0)] * 2, micro_batches=5)
    result = simulate(plan, steps=6)
    assert result.samples_per_s == pytest.approx(5 * 2 / result.step_time_s)
    assert len(result.step_ends_s) == 6 and list(result.step_ends_s) == sorted(result.step_ends_s)
    assert {e.mb for e in result.timeline if e.kind == "F"} == set(range(15))  # first 3 steps


def test_result_json_round_trip(plan_factory):
    result = simulate(plan_factory([(1.0, 2.0, 1.0)] * 3, micro_batches=2), steps=3)
    assert SimResult.from_json(result.to_json()) == result


def test_bad_requests(plan_factory):
    plan = plan_factory([(1.0, 2.0, 1.0)] * 2)
    with pytest.raises(
        FtpipeError,
        match="unknown schedule 'zigzag'; choose from 1f1b, 2bw, ftpipe, gpipe, interleaved, wpipe, zb1p, zb2p, zbv",
    ):
        simulate(plan, "zigzag")
    with pytest.raises(FtpipeError, match="at least 1"):
        simulate(plan, steps=0)


@pytest.mark.parametrize("gpus,m", [(2, 4), (4, 4), (4, 8), (8, 8), (8, 10)])
def test_2bw_and_wpipe_run_at_the_busiest_gpus_work_on_uniform_stages(plan_factory, gpus, m):
    """No flush: 2BW's steady step is m periods; WPipe's two half stages per GPU, merged
    alternately, fill G1's per-step flush with G0's work, so it matches (WPipe §3.2)."""
    two_bw = plan_factory([(1.0, 2.0, 1.0)] * gpus, schedule="2bw", micro_batches=m)
    halves = [(0.5, 1.0, 0.5)] * (2 * gpus)
    looped = [p % gpus for p in range(2 * gpus)]
    wpipe = plan_factory(halves, gpu_of=looped, schedule="wpipe", micro_batches=m)
    for plan in (two_bw, wpipe):
        result = simulate(plan, steps=10)
        assert result.step_time_s == pytest.approx(plan.period_s * m, rel=1e-9), plan.schedule


def test_a_tied_weight_goes_once_per_version(plan_factory):
    """As the runtime sends it: the weight after the activations of the owner's first
    forward of the step, its gradient summed after the reader's last backward, waited for by
    the owner's last only; under the asynchronous schedule too, its owner stepping once a
    step."""
    costs, m = [(1.0, 2.0, 0.0)] * 2, 2
    # Activations free, the 10,000-byte weight 10 s on the link.
    plan = plan_factory(costs, micro_batches=m, tied=[(0, 1)], tied_bytes=10_000, bandwidth=1e3)
    sync = simulate(plan, "gpipe", steps=1)
    # GPU 0: F0 [0, 1], F1 [1, 2], the weight arrives at 11; GPU 1: F0, F1 [11, 13], B1, B0
    # [13, 17], the summed gradient arrives at 27; GPU 0: B1 [15, 17], B0 [27, 29].
    assert sync.step_time_s == pytest.approx(29.0)
    assert [g.bytes_sent for g in sync.gpus] == [10_000, 10_000]
    owner = sorted((e.mb, e.start) for e in sync.timeline if e.stage == 0 and e.kind in "BR")
    assert owner == [(0, pytest.approx(27.0)), (1, pytest.approx(15.0))]
    each = simulate(plan, "ftpipe", steps=4)
    assert [g.bytes_sent for g in each.gpus] == [10_000, 10_000]


def test_optimizer_steps_and_message_latency_take_their_time(plan_factory):
    """A stage's S takes its optimizer step (Stage.step_s); every message waits the link's
    latency before its bytes. GPipe on two GPUs: both steps run side by side after the flush
    (+1 s); the critical path crosses the link twice per step (the last activation out, the
    last gradient back: +2 latencies)."""
    plan = plan_factory([(1.0, 2.0, 0.0)] * 2, micro_batches=2, bandwidth=1e3, nbytes=0)
    plain = simulate(plan, "gpipe", steps=4).step_time_s
    stepping = plan.with_(stages=tuple(replace(s, step_s=1.0) for s in plan.stages))
    assert simulate(stepping, "gpipe", steps=4).step_time_s == pytest.approx(plain + 1.0)
    late = simulate(plan.with_(latency_s=0.25), "gpipe", steps=4)
    assert late.step_time_s == pytest.approx(plain + 2 * 0.25)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_a_synchronous_step_sends_its_new_weight_at_once(plan_factory, schedule):
    """As the runtime does (`Dataflow`): the version a step makes leaves when the owner's GPU
    has stepped, crossing while the owner runs its next forward; the reader's first forward
    of the step waits for it (2 s on the link) and not for that forward (1 s) as well."""
    kw = dict(schedule=schedule, micro_batches=2, bandwidth=1000.0)
    result = simulate(plan_factory([(1.0, 2.0, 1.0)] * 2, tied=[(0, 1)], tied_bytes=2000, **kw))
    ev = {(e.stage, e.kind, e.mb): e for e in result.timeline}
    stepped = ev[(0, "S", 0)].end
    assert ev[(1, "F", 2)].start == pytest.approx(stepped + 2.0, abs=1e-6)


def test_kept_action_lists_give_the_same_simulation_and_are_each_callers_own(plan_factory):
    """simulate keeps a schedule's action lists for stages placed alike: a second simulation
    of the plan (or a like one) finds them kept and simulates the same step, and what one
    caller does to its lists never reaches the next."""
    from ftpipe_compiler.simulate import simulator

    plan = plan_factory([(1.0, 2.0, 0.5), (2.0, 3.0, 0.0), (1.5, 2.0, 1.0)], schedule="1f1b",
                        micro_batches=4)  # fmt: skip
    simulator._LISTS.clear()
    first = simulate(plan, steps=3)
    assert len(simulator._LISTS) == 1
    again = simulate(plan, steps=3)
    assert len(simulator._LISTS) == 1  # found, not made again
    assert again.step_time_s == first.step_time_s and again.timeline == first.timeline
    sched = get_schedule("1f1b")
    args = (sched, "1f1b", plan.recompute, plan.stage_infos(), 4, 3)
    mine = simulator._action_lists(*args)
    assert mine == sched.actions(plan.stage_infos(), 4, 3)
    for acts in mine.values():
        acts.clear()
    assert simulator._action_lists(*args) == sched.actions(plan.stage_infos(), 4, 3)


def test_steady_steps_hold_the_micro_batches_and_give_the_step_time(plan_factory, seed):
    """A search ranks plans on `steady_steps`: with many micro-batches per step, 4 steps say
    what `steps` do, at a fraction of the cost (linear in steps x micro-batches)."""
    from ftpipe_compiler.simulate import steady_steps

    assert steady_steps(4, 20) == 20  # a replica's few micro-batches: as asked
    assert steady_steps(10, 20) == 16
    assert steady_steps(32, 20) == 5
    assert steady_steps(40, 20) == 4
    assert steady_steps(160, 20) == 2  # the window is the second half: 1 warms up, 1 measured
    assert steady_steps(160, 2) == 2  # never more than asked
    rng = random.Random(seed)
    for schedule in ("gpipe", "1f1b", "ftpipe", "2bw", "zb1p"):
        costs = [(rng.uniform(0.5, 2), rng.uniform(1, 4), rng.uniform(0.5, 2)) for _ in range(6)]
        plan = plan_factory(costs, micro_batches=48, schedule=schedule, tied=[(0, 5)])
        few, many = (simulate(plan, steps=n) for n in (steady_steps(48, 20), 20))
        assert few.step_time_s == pytest.approx(many.step_time_s, rel=1e-9), schedule


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "ftpipe", "2bw", "zb1p", "zb2p"])
def test_a_steady_run_ends_early_with_the_figures_of_a_full_one(plan_factory, seed, schedule):
    """`steady=True` (a search's cells): the run ends once 3 steps in a row took the same
    time, or after the last step measured (an asynchronous pipeline's drain left out); its
    figures are the full run's."""
    rng = random.Random(seed)
    stopped = 0
    for m in (3, 8, 40):
        costs = [(rng.uniform(0.5, 2), rng.uniform(1, 4), rng.uniform(0.5, 2)) for _ in range(4)]
        plan = plan_factory(costs, micro_batches=m, schedule=schedule, tied=[(0, 3)])
        full = simulate(plan, steps=steady_steps(m, 12))
        steady = simulate(plan, steps=12, steady=True)
        assert steady.steps <= full.steps
        stopped += steady.steps < full.steps
        assert steady.step_time_s == pytest.approx(full.step_time_s, rel=1e-9)
        assert steady.bubble_fraction == pytest.approx(full.bubble_fraction, rel=1e-9, abs=1e-12)
        for a, b in zip(steady.gpus, full.gpus):
            assert a.busy_fraction == pytest.approx(b.busy_fraction, rel=1e-9)
            assert a.peak_memory_bytes == b.peak_memory_bytes
        assert steady.in_flight == full.in_flight
    assert stopped  # settled before 12 steps at least once


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "ftpipe", "2bw", "zb1p", "zb2p"])
def test_a_run_without_its_drain_is_the_full_run(plan_factory, seed, schedule):
    """`drain=False` (the plan a search keeps): every step run, the asynchronous pipeline's
    drain after the last left out; every figure, timeline included, is the full run's."""
    rng = random.Random(seed)
    for m in (3, 8, 40):
        costs = [(rng.uniform(0.5, 2), rng.uniform(1, 4), rng.uniform(0.5, 2)) for _ in range(4)]
        plan = plan_factory(costs, micro_batches=m, schedule=schedule, tied=[(0, 3)])
        for steps in (2, 5):
            assert simulate(plan, steps=steps, drain=False) == simulate(plan, steps=steps)
