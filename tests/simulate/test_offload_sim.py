"""Offloaded stages in the simulator (`simulate/host.py`): the host link's copies and the
CPU's optimizer step as the runtime runs them, what the schedule hides of the step, host
memory per node, and the host's marks on the timeline."""

from __future__ import annotations

from dataclasses import replace

import pytest
from sim_plans import make_plan

from ftpipe_compiler.costs.host import Host, Offload, host_memory
from ftpipe_compiler.plan import PlanParam
from ftpipe_compiler.planner.offload import choose_offload
from ftpipe_compiler.simulate import render_report, simulate
from ftpipe_compiler.simulate.host import offload_lines
from ftpipe_compiler.simulate.simulator import cpu_step_hidden, offload_report

NUMEL = 2_000_000  # each stage's one fp32 weight: 8 MB
HOST = Host(memory_bytes=10**12, link_bandwidth=1e9, node_bandwidth=4e9, step_bandwidth=2e8,
            sum_bandwidth=1e10, gpus_per_node=8)  # fmt: skip
# sgd: master and summed gradient, fp32, and the clip's 3 passes over the gradient: 0.2 s
CPU_S = (2 + 3) * 4 * NUMEL / 2e8
UPLOAD_S = 4 * NUMEL / 1e9  # the new weights back
GRAD_S = 4 * NUMEL / 1e9 + 12 * NUMEL / 1e10  # a micro-batch's gradient down, and its sum


def _plan(costs, schedule, gpu_of=None, offload=(), activations=(), m=4, gradients="host"):
    plan = make_plan(costs, gpu_of=gpu_of, schedule=schedule, micro_batches=m,
                     memory_bytes=10**12)  # fmt: skip
    params = tuple(
        PlanParam(p.name, (NUMEL,), "float32", 4 * NUMEL, 8 * NUMEL, True, (), p.stages)
        for p in plan.params
    )
    stages = tuple(
        replace(
            s,
            offload=Offload(
                optimizer=s.id in offload, activations=s.id in activations, gradients=gradients
            ),
        )  # fmt: skip
        for s in plan.stages
    )
    return plan.with_(params=params, stages=stages, host=HOST)


def test_one_gpu_pays_the_whole_host_step():
    """Nothing hides anything on one GPU: the step grows by the host step and upload in place
    of the device's step, and m micro-batches' gradient copies and sums, to the nanosecond."""
    m = 4
    plain = simulate(_plan([(1.0, 2.0, 0.0)], "gpipe", m=m))
    off = simulate(_plan([(1.0, 2.0, 0.0)], "gpipe", offload={0}, m=m))
    device_step = _plan([(1.0, 2.0, 0.0)], "gpipe").stages[0].step_s
    want = plain.step_time_s - device_step + CPU_S + UPLOAD_S + m * GRAD_S
    assert off.step_time_s == pytest.approx(want, rel=1e-9)
    assert off.gpus[0].cpu_step_s == pytest.approx(CPU_S)
    assert (off.gpus[0].host_bytes_down, off.gpus[0].host_bytes_up) == (m * 4 * NUMEL, 4 * NUMEL)
    assert off.step_time_s - plain.step_time_s >= CPU_S  # at least the CPU step: none hidden
    assert cpu_step_hidden(_plan([(1.0, 2.0, 0.0)], "gpipe", offload={0}), off) == pytest.approx(0)


def test_gradients_summed_on_the_device_cross_once_at_the_step():
    """Summed on the GPU: the backwards are the plain ones, the S copies the fp32 sum down
    once (4 B an element) before the CPU step and the upload: m x fewer bytes down here."""
    m = 4
    plain = simulate(_plan([(1.0, 2.0, 0.0)], "gpipe", m=m))
    plan = _plan([(1.0, 2.0, 0.0)], "gpipe", offload={0}, m=m, gradients="device")
    off = simulate(plan)
    device_step = _plan([(1.0, 2.0, 0.0)], "gpipe").stages[0].step_s
    sum_s = 4 * NUMEL / 1e9
    want = plain.step_time_s - device_step + sum_s + CPU_S + UPLOAD_S
    assert off.step_time_s == pytest.approx(want, rel=1e-9)
    assert (off.gpus[0].host_bytes_down, off.gpus[0].host_bytes_up) == (4 * NUMEL, 4 * NUMEL)
    marks = [e for e in off.timeline if e.kind == "D"]
    assert marks and all(e.end - e.start == pytest.approx(sum_s) for e in marks)
    lines = offload_lines(plan, off)
    assert "offloads its optimizer state (its gradients summed on the GPU, sent once" in lines[0]


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_a_synchronous_step_hides_only_behind_other_stages_forwards(schedule):
    """Under a flush the first stage's CPU step delays the next step's first forward, which
    every later stage waits for: none of it hidden. The last stage's is hidden by the next
    step's forwards of the stages before it (1 s each, far longer than its step)."""
    costs = [(1.0, 2.0, 0.0), (1.0, 2.0, 0.0)]
    base = _plan(costs, schedule)
    plain = simulate(base).step_time_s
    first = _plan(costs, schedule, offload={0})
    sim = simulate(first)
    hidden = cpu_step_hidden(first, sim)
    assert hidden == pytest.approx(0.0, abs=1e-9)
    assert sim.step_time_s - plain >= (1 - hidden) * CPU_S
    last = _plan(costs, schedule, offload={1})
    sim = simulate(last)
    assert cpu_step_hidden(last, sim) == pytest.approx(1.0)


def test_ftpipe_hides_the_step_of_a_gpu_with_slack_and_not_of_the_bottleneck():
    """FTPipe's asynchronous schedule: no GPU waits for another's step, so a light GPU's CPU
    step fills its idle time (the step time does not change); on the slowest GPU it is paid."""
    costs = [(0.3, 0.6, 0.3), (1.0, 2.0, 1.0)]  # GPU 0 idles two thirds of the time
    plain = simulate(_plan(costs, "ftpipe")).step_time_s
    light = _plan(costs, "ftpipe", offload={0})
    sim = simulate(light)
    assert cpu_step_hidden(light, sim) == pytest.approx(1.0)
    assert sim.step_time_s == pytest.approx(plain, rel=1e-6)
    heavy = _plan(costs, "ftpipe", offload={1})
    sim = simulate(heavy)
    assert cpu_step_hidden(heavy, sim) < 0.5
    assert sim.step_time_s - plain >= (1 - cpu_step_hidden(heavy, sim)) * CPU_S - 1e-9


def test_2bw_overlaps_the_cpu_step_with_the_stage_actions_on_the_older_version():
    """PipeDream-2BW runs step k + 1's micro-batches on the weights before step k: the CPU
    step runs beside them (`HostOffload.launch`), and lands (uploaded) at the first forward
    on the version it made, step k + 2's. Every GPU offloads and the whole step is hidden;
    FTPipe's next forward reads the newest weights, so it waits for it there."""
    costs, m = [(1.0, 2.0, 0.0), (1.0, 2.0, 0.0)], 4
    plain = simulate(_plan(costs, "2bw", m=m)).step_time_s
    plan = _plan(costs, "2bw", offload={0, 1}, m=m)
    sim = simulate(plan)
    assert cpu_step_hidden(plan, sim) == pytest.approx(1.0)
    assert sim.step_time_s < plain + CPU_S  # less than one GPU's step alone (0.4 s: shared)
    c = next(e for e in sim.timeline if (e.gpu, e.kind, e.mb) == (0, "C", 0))
    s0 = next(e for e in sim.timeline if (e.gpu, e.kind, e.mb) == (0, "S", 0))
    u = next(e for e in sim.timeline if (e.gpu, e.kind, e.mb) == (0, "U", 0))
    f = next(e for e in sim.timeline if (e.gpu, e.kind, e.mb) == (0, "F", 2 * m))
    assert c.start == s0.end and u.start == f.start > c.end
    ftpipe = _plan(costs, "ftpipe", offload={0, 1}, m=m)
    assert cpu_step_hidden(ftpipe, simulate(ftpipe)) == pytest.approx(0.0)


@pytest.mark.parametrize("costs,meets", [((0.01, 0.02, 0.0), True), ((1.0, 2.0, 0.0), False)])
def test_a_second_gradient_sum_is_held_where_a_backward_meets_the_cpu_step(costs, meets):
    """Under 2BW a stage's backwards on the older version follow its S: one that starts
    while the CPU step still runs has its gradient summed apart beside the step's sum
    (`HostOffload._add`: 4 B an element in fp32), and the node's simulated host memory counts
    it (on a CPU rank, `device_is_host`, the rank's peak); where the step ends first (slower
    compute), the sum it read is gone by then. The plan alone cannot tell, and counts it
    (`costs.host.sums_apart`)."""
    plan = _plan([costs, costs], "2bw", offload={0, 1}, m=4)
    sim = simulate(plan)
    assert sim.sums_apart == ((0, 1) if meets else ())
    assert plan.sums_apart == {0, 1}
    in_flight = dict(enumerate(sim.in_flight))
    both, one = (host_memory(plan, in_flight, apart)[0] for apart in ({0, 1}, set()))
    assert both - one == 2 * 4 * NUMEL
    assert sim.nodes[0].host_bytes == (both if meets else one)
    on_cpu = plan.with_(host=replace(HOST, device_is_host=True))
    peaks = [g.peak_memory_bytes for g in simulate(on_cpu).gpus]
    assert peaks == [on_cpu.gpu_memory(g, in_flight, apart=(set(), {0, 1})[meets]) for g in (0, 1)]
    assert all(on_cpu.gpu_memory(g) - p == (0 if meets else 4 * NUMEL) for g, p in enumerate(peaks))


def _lagged(plan):
    return choose_offload(plan, "none", step="lagged")


def test_a_lagged_step_lands_at_the_next_s_and_ftpipe_hides_it():
    """--offload-step lagged under FTPipe: the CPU step runs beside the stage's next actions,
    which read the older weights, and lands (uploaded) at the stage's next S. The bottleneck
    GPU's step, exposed landing exactly, is then hidden."""
    costs, m = [(0.3, 0.6, 0.3), (1.0, 2.0, 1.0)], 4
    plain = simulate(_plan(costs, "ftpipe", m=m)).step_time_s
    exact = _plan(costs, "ftpipe", offload={1}, m=m)
    assert cpu_step_hidden(exact, simulate(exact)) < 0.5
    lagged = _lagged(exact)
    assert [s.offload.step for s in lagged.stages] == ["exact", "lagged"]
    sim = simulate(lagged)
    assert cpu_step_hidden(lagged, sim) == pytest.approx(1.0)
    assert sim.step_time_s < plain + m * GRAD_S + UPLOAD_S + 1e-9
    c = next(e for e in sim.timeline if (e.gpu, e.kind, e.mb) == (1, "C", 0))
    u = next(e for e in sim.timeline if (e.gpu, e.kind, e.mb) == (1, "U", 0))
    s1 = next(e for e in sim.timeline if (e.gpu, e.kind, e.mb) == (1, "S", 1))
    assert u.start == s1.start > c.end
    # Under 1F1B the next forward needs the newest weights: nothing lags.
    assert _lagged(_plan(costs, "1f1b", offload={1})).stages[1].offload.step == "exact"


def test_offloaded_activations_wait_only_for_what_the_prefetch_did_not_hide():
    """A backward waits for what its stage kept (gpipe recomputes: the stage's 100 B of
    inputs) to come back over the host link: with a fast link the fetch, issued one backward
    ahead, is hidden; with a slow one the step grows."""
    costs = [(1.0, 2.0, 0.0), (1.0, 2.0, 0.0)]
    plain = simulate(_plan(costs, "gpipe")).step_time_s
    fast = simulate(_plan(costs, "gpipe", activations={0}))
    assert fast.step_time_s == pytest.approx(plain, rel=1e-3)
    slow_host = replace(HOST, link_bandwidth=10.0, node_bandwidth=40.0)  # 10 s a way
    slow = simulate(_plan(costs, "gpipe", activations={0}).with_(host=slow_host))
    assert slow.step_time_s > plain + 0.5
    kinds = {e.kind for e in slow.timeline if e.gpu == 0}
    assert {"O", "I"} <= kinds  # on the timeline, beside the GPU's own actions
    # The GPU keeps two micro-batches' inputs; the host the other two of gpipe's four.
    kept = simulate(_plan(costs, "gpipe")).gpus[0].peak_memory_bytes
    assert slow.gpus[0].peak_memory_bytes == kept - 2 * 100
    assert slow.nodes[0].host_bytes == 2 * 100


def test_a_forward_followed_by_its_own_backward_parks_nothing():
    """As the runtime does (`act_offload`): 1F1B's last stage runs each micro-batch's backward
    right after its forward, so nothing of it goes to the host (on the H200 the simulator had
    charged 1.69 s a step for copies the runtime never made, against 0.56 s measured); GPipe's
    last forward before the backwards keeps its tensors too."""
    costs = [(1.0, 2.0, 0.0), (1.0, 2.0, 0.0)]
    slow_host = replace(HOST, link_bandwidth=10.0, node_bandwidth=40.0)  # 100 s a way
    plain = simulate(_plan(costs, "1f1b")).step_time_s
    last = simulate(_plan(costs, "1f1b", activations={1}).with_(host=slow_host))
    assert last.step_time_s == pytest.approx(plain, rel=1e-9)
    assert not any(e.kind in "OI" for e in last.timeline)
    assert (last.gpus[1].host_bytes_down, last.gpus[1].host_bytes_up) == (0, 0)
    first = simulate(_plan(costs, "gpipe", activations={0}).with_(host=slow_host))
    parked = {e.mb for e in first.timeline if e.kind == "O" and e.mb < 4}
    assert parked == {0, 1, 2}  # micro-batch 3's backward follows its forward
    assert first.gpus[0].host_bytes_down == 3 * 100  # a step: 3 of 4 micro-batches' inputs


def test_host_memory_per_node_is_checked():
    plan = _plan([(1.0, 2.0, 0.0)], "gpipe", offload={0})
    assert simulate(plan).fits
    # needs 12 B an element: master, sum and landing buffer (under GPipe no backward comes
    # while the overlapped step runs: no next step's sum beside the one it reads)
    small = plan.with_(host=replace(HOST, memory_bytes=10 * NUMEL))
    sim = simulate(small)
    assert not sim.fits and not sim.nodes[0].fits and sim.nodes[0].host_bytes == 12 * NUMEL
    lines = offload_lines(small.with_(model={**small.model, "offload": "optimizer"}), sim)
    assert lines[0] == "stage 0 (GPU 0) offloads its optimizer state: --offload optimizer"
    assert "host traffic per step" in lines[-1]


def test_the_timeline_marks_copies_and_the_cpu_step():
    sim = simulate(_plan([(1.0, 2.0, 0.0), (1.0, 2.0, 0.0)], "1f1b", offload={1}))
    marks = [e for e in sim.timeline if e.kind in "DCU" and e.gpu == 1]
    steps = {e.mb for e in marks if e.kind == "C"}
    assert steps == {0, 1, 2}  # the report's first three steps
    c = next(e for e in marks if e.kind == "C" and e.mb == 0)
    assert c.end - c.start == pytest.approx(CPU_S)
    # Overlapped: the new weights go up where the stage's next forward (step 1's first)
    # starts, once its input is there, after the CPU step ended.
    u = next(e for e in marks if e.kind == "U" and e.mb == 0)
    f = next(e for e in sim.timeline if (e.gpu, e.stage, e.kind, e.mb) == (1, 1, "F", 4))
    assert u.start == f.start >= c.end and u.end - u.start == pytest.approx(UPLOAD_S)
    assert sum(1 for e in marks if e.kind == "D" and e.mb < 4) == 4  # one per backward


def test_the_report_draws_a_host_row_and_says_what_was_offloaded():
    plan = _plan([(1.0, 2.0, 0.0), (1.0, 2.0, 0.0)], "1f1b", offload={1})
    plan = plan.with_(model={**plan.model, "offload": "optimizer"})
    html = render_report(plan, simulate(plan))
    assert ">host 1</text>" in html and ">host 0</text>" not in html  # only the offloading GPU
    assert "stage 1 optimizer step on the CPU, step 0" in html
    assert "stage 1 gradients to the host, micro-batch 0" in html
    assert "stage 1 (GPU 1) offloads its optimizer state: --offload optimizer" in html
    assert "100% of it hidden by the schedule" in html  # the last stage, behind stage 0


def test_an_exposed_cpu_step_is_priced_with_what_trains_without_offload():
    """A planner's offload (`auto`) whose CPU step is most of the step says so, and names
    the options that need no offload; not when the user forced it, nor when it is small."""
    tiny = _plan([(0.01, 0.02, 0.0)], "gpipe", offload={0})  # a 0.12 s step of compute
    sim = simulate(tiny)
    line = offload_lines(tiny, sim, cpu_step_hidden(tiny, sim))[-1]
    exposed = sim.gpus[0].cpu_step_s  # one GPU: none of it hidden
    assert line == (
        f"offload costs time: about {exposed:.3g} s of each {sim.step_time_s:.3g} s step is "
        "the CPU optimizer step, which no GPU's work hides; --dtype bf16-pure or --lora may "
        "train without offload, with other numerics (`--offload none` says what they need)"
    )
    # Under FTPipe's schedule the line also prices the lagged step, simulated.
    heavy = _plan([(0.01, 0.02, 0.01), (0.01, 0.02, 0.01)], "ftpipe", offload={0, 1})
    heavy_sim = simulate(heavy)
    line = offload_report(heavy, heavy_sim)[-1]
    lagged = simulate(_lagged(heavy)).step_time_s
    assert lagged < heavy_sim.step_time_s
    assert (
        f"no GPU's work hides; --offload-step lagged makes it {lagged:.3g} s (each offloaded "
        "stage's actions read its weights one step older); --dtype bf16-pure" in line
    )
    assert "--offload-step lagged makes" not in offload_report(_lagged(heavy), heavy_sim)[-1]
    lora = tiny.with_(model={**tiny.model, "lora": {"r": 16}})
    assert "; --dtype bf16-pure may train" in offload_lines(lora, sim, 0.0)[-1]
    forced = tiny.with_(model={**tiny.model, "offload": "optimizer"})
    assert offload_lines(forced, sim, 0.0)[-1].startswith("host traffic per step")
    big = _plan([(1.0, 2.0, 0.0)], "gpipe", offload={0})  # 0.2 s of a ~12.5 s step
    big_sim = simulate(big)
    assert offload_lines(big, big_sim, 0.0)[-1].startswith("host traffic per step")
