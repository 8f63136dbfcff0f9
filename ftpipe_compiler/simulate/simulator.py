"""A discrete-event simulation of a plan under a schedule: the judge between plans.

    result = simulate(plan)                                   # the plan's own schedule
    result = simulate(plan, "gpipe", micro_batches=8, steps=4)
    cpu_step_hidden(plan, result)       # offloaded: the share of the CPU step the schedule hides
    offload_report(plan, result)        # what it offloads and what that costs, for people

Each GPU runs the schedule's action list (the runtime's very lists, checked by the same
`validate`; a CSV file of per-GPU actions works as well) strictly in order; an action
starts when its GPU is free and its inputs have arrived. F takes the stage's fwd_s when
it recomputes (per the schedule, not the plan's flags), and B its bwd_s plus recompute_s;
else F records the graph B uses (`Stage.forward_s`: recompute_s, the forward recording)
and B takes bwd_s;
a schedule that splits the backward runs B for bwd_s - wgrad_s and W for wgrad_s.
A tensor crossing to another GPU goes once per destination GPU over that directed link,
one tensor at a time, while compute goes on; a gradient goes back once per consumer GPU.
A weight read by several stages is one such tensor, sent by its owner once per version of
its weights (it changes only at the owner's step; under a synchronous schedule once per
step), its gradient summed over the step coming back once, as the runtime does. Stages on one
GPU hand over for free. A tensor's time on a link is the link's latency plus its bytes over
the bandwidth. A stage's S takes its optimizer step's time (`Stage.step_s`: its weights,
gradients and optimizer state streamed at the machine's step bandwidth). Under a
synchronous schedule every GPU's optimizer steps wait for the slowest GPU (the flush, and
one gradient norm); under the asynchronous one every stage steps at its own pace. A stage that
offloads its optimizer or activations to the host adds the host link's copies and the CPU's
step as the runtime runs them (`host.HostTraffic`); each node's host memory is checked against
its hardware's (`SimResult.nodes`). With replicas (data parallelism) one
replica is timed, its links and the all-reduce of each stage's gradients modelled by
`network.Network`; samples/s count every replica.

Figures (see SimResult): E_k is the time the slowest GPU finishes step k (its last S);
the step time is the mean of E_k - E_{k-1} over the last half of the steps, and a GPU's busy
fraction is the compute of those steps' actions over that same window (by step, not by the
clock: a finite run lacks the next step's work that a steady one starts before E_k, so that
a window of few steps measures what one of many does). An asynchronous pipeline never
drains between steps, so it is simulated with enough extra micro-batches after the last
measured step that no measured step includes the drain.
"""

from __future__ import annotations

import math
from dataclasses import replace

from ftpipe_runtime.schedules import (
    SCHEDULES,
    ForwardVersions,
    ScheduleError,
    StageGraph,
    resolve_schedule,
    validate,
)

from ..costs.host import host_memory, lagged
from ..errors import FtpipeError, unknown
from ..plan import Plan
from .engine import SETTLED, EventLoop
from .host import HostTraffic, offload_lines, offloaded
from .result import GpuResult, NodeResult, SimResult

TIMELINE_STEPS = 3  # steps kept on the timeline for the report


MAX_ACTIONS = 5_000_000  # what one simulation may execute: about a minute


def simulate(
    plan: Plan,
    schedule: str | None = None,
    micro_batches: int | None = None,
    steps: int = 10,
    *,
    weights_once: bool = True,
    checked: bool = True,
    steady: bool = False,
    drain: bool = True,
) -> SimResult:
    """`weights_once=False` sends a weight read by other stages with every micro-batch, as
    the runtime did before (benchmarks compare the bytes); the runtime itself never does.
    `checked=False` leaves out `validate` of the lists: a search simulating many plans
    checks the one it keeps (the runtime checks its lists again when it starts).
    `steady`: `steps` at most, as few as show the steady state (a search ranking many
    plans): `steady_steps`, and the run ends early once `SETTLED` steps in a row took the
    same time (`EventLoop`'s `settle`). `drain=False`: all `steps`, but the run ends
    once the last of them ended on every GPU: an asynchronous pipeline's drain after it
    changes no figure of those steps (the same result, without the drain's events)."""
    got = _run(plan, schedule, micro_batches, steps, weights_once, checked, steady, drain)
    return _result(*got)


STEADY_MICRO_BATCHES = 160  # what a few steps must hold to show the steady state
STEADY_STEPS = 2  # at least: the window is the second half, so 1 warms up and 1 is measured


def steady_steps(micro_batches: int, steps: int) -> int:
    """Steps a search simulates to rank plans of `micro_batches` per step, `steps` at most:
    with many micro-batches per step (a cluster's replica: 160) a few steps hold as many as
    `steps` of a replica's few, and the cost is linear in steps x micro-batches. T5-11B's
    16-GPU replica (Mixed-pipe's cut) at 80 and 160 micro-batches: 2, 3, 4 and 10 steps gave
    the same step time to 1e-9 under gpipe, 1f1b, ftpipe and 2bw; at 40, 2 steps were 0.5%
    off 10 under the asynchronous ones, 4 steps 0.1% (the window holds 80 micro-batches)."""
    return min(steps, max(STEADY_STEPS, -(-STEADY_MICRO_BATCHES // max(micro_batches, 1))))


def step_time(plan: Plan, steps: int = 10, *, steady: bool = False) -> float:
    """`simulate(plan, steps=steps, checked=False, steady=steady).step_time_s` without the
    other figures (each GPU's memory, busy fractions): what a search judging many candidates
    reads."""
    got = _run(plan, None, None, steps, True, False, steady)
    return _window(got[1], got[3])[2]


def _run(plan: Plan, schedule, micro_batches, steps: int, weights_once: bool, checked: bool,
         steady: bool = False, drain: bool = True):  # fmt: skip
    """The event loop run to its end, and what `_result` reads besides (`steady`: the steps
    as `simulate` says)."""
    name = schedule or plan.schedule
    if name not in SCHEDULES and not name.lower().endswith(".csv"):
        raise unknown("schedule", name, SCHEDULES)
    try:
        sched = resolve_schedule(name, plan.recompute)
    except ScheduleError as e:
        raise FtpipeError(str(e)) from None
    m = micro_batches or sched.micro_batches or plan.micro_batches
    if m < 1 or steps < 1:
        raise FtpipeError(f"micro-batches and steps must be at least 1, not {m} and {steps}")
    if steady:
        steps = steady_steps(m, steps)
    actions = 3 * steps * m * len(plan.stages)  # a forward, a backward, a weight pass at most
    if actions > MAX_ACTIONS:
        raise FtpipeError(
            f"{steps} steps of {m} micro-batches on {len(plan.stages)} stages are {actions:.2g} "
            f"actions to simulate, more than {MAX_ACTIONS:.0g} (minutes); lower --steps or "
            "--micro-batches (per-step figures are the steady state's: 10 steps show it)"
        )
    infos = plan.stage_infos()
    policies = sched.policies(infos, m)
    # Which stages recompute depends on the schedule, and memory follows from that.
    plan = plan.with_(
        schedule=name,
        micro_batches=m,
        stages=tuple(replace(s, recompute=policies[s.id].recompute) for s in plan.stages),
    )
    groups = sched.step_groups(infos)  # the optimizer steps that wait for each other
    # A pipeline that never drains keeps streaming after the last measured step: simulate
    # enough further steps (every stage runs up to its in-flight count ahead) that no
    # measured step is part of the drain.
    ahead = max((p.in_flight for p in policies.values()), default=0)
    run_steps = steps + (0 if sched.synchronous else -(-ahead // m))
    consumers = {s.id: set() for s in plan.stages}
    for t in plan.transfers:
        consumers[t.producer].update(t.consumers)
    try:
        sched.check(infos, m)
    except ScheduleError as e:
        raise FtpipeError(str(e)) from None
    try:
        lists = _action_lists(sched, name, plan.recompute, infos, m, run_steps)
        if checked:
            validate(lists, StageGraph.of(infos, consumers), sched, m, run_steps)
    except ScheduleError as e:
        raise FtpipeError(f"schedule {name}: {e}") from None
    # A weight read by other stages goes once per version of its owner's weights, the
    # micro-batches reading each version counted by the runtime's own ForwardVersions.
    owners = plan.weight_owners()
    gpu = {s.id: s.gpu for s in plan.stages}
    versions = {s: ForwardVersions(lists[gpu[s]], s, policies[s], m) for s in owners}
    kept = min(steps, TIMELINE_STEPS)
    host = (
        HostTraffic(plan, lists, kept * m, kept, synchronous=sched.synchronous)
        if any(s.offload.any for s in plan.stages)
        else None
    )
    run = EventLoop(
        plan,
        lists,
        groups,
        m * run_steps,
        min(steps, TIMELINE_STEPS),
        m,
        versions,
        weights_once,
        synchronous=sched.synchronous,
        host=host,
        stop_after=steps if steady or not drain else 0,
        settle=steady,
    )
    run.go()
    return plan, run, name, run.settled_at or steps, m, run_steps, host


_KEEP_LISTS = 64
_LISTS: dict[tuple, dict] = {}  # (schedule, recompute, stages, m, steps) -> lists, oldest first


def _action_lists(sched, name: str, recompute: bool, infos, m: int, steps: int) -> dict:
    """The schedule's action lists for these stages, kept: a search simulates many plans
    whose stages sit alike (a chain of one stage per GPU under each schedule, Mixed-pipe's
    candidates), and the lists depend on the built-in schedule and the stages' places alone
    (a .csv schedule is read again each time). Each caller gets its own lists."""
    if name.lower().endswith(".csv"):
        return sched.actions(infos, m, steps)
    key = (name, recompute, tuple(infos), m, steps)
    got = _LISTS.get(key)
    if got is None:
        while len(_LISTS) >= _KEEP_LISTS:
            _LISTS.pop(next(iter(_LISTS)))
        got = _LISTS[key] = sched.actions(infos, m, steps)
    return {g: list(acts) for g, acts in got.items()}


def _window(run: EventLoop, steps: int) -> tuple[list[float], tuple[float, float], float]:
    """(when each step ends, the window measured: the second half of the steps, the first
    half warming the pipeline up, or the steps that settled where the run ended early; the
    mean step time over it)."""
    ends = run.ends[:steps]  # E_k, as the loop counted them
    n = len(_measured(run, steps))
    window = (ends[-1 - n], ends[-1]) if n < steps else (0.0, ends[0])
    return ends, window, (window[1] - window[0]) / n


def _measured(run: EventLoop, steps: int) -> range:
    """The steps the window holds."""
    n = SETTLED if run.settled_at else steps // 2
    return range(steps - n, steps) if n else range(1)


def _result(plan: Plan, run: EventLoop, name: str, steps: int, m: int, run_steps: int,
            host: HostTraffic | None = None):  # fmt: skip
    """The figures of a finished run: step time over the second half of the steps, busy
    fractions and peak memory per GPU; with offloaded stages their host traffic and each
    node's host memory."""
    ends, window, step_time = _window(run, steps)
    measured = _measured(run, steps)
    busy = {
        g: sum(run.busy.get((g, k), 0.0) for k in measured) / max(window[1] - window[0], 1e-30)
        for g in range(plan.gpus)
    }
    in_flight = {s.id: run.peak[s.id] for s in plan.stages}
    apart = frozenset(host.apart) if host is not None else None
    traffic = host.per_step(m) if host is not None else {}
    none = {"down": 0, "up": 0, "cpu_s": 0.0}
    gpus = tuple(
        GpuResult(
            gpu=g,
            busy_fraction=busy[g],
            peak_memory_bytes=plan.gpu_memory(g, in_flight, run.peak_deferred, apart),
            memory_bytes=plan.memory_bytes,
            stages=tuple(s.id for s in plan.stages_on(g)),
            bytes_sent=round(sum(run.sent_in.get((g, k), 0) for k in measured) / len(measured)),
            host_bytes_down=traffic.get(g, none)["down"],
            host_bytes_up=traffic.get(g, none)["up"],
            cpu_step_s=traffic.get(g, none)["cpu_s"],
        )
        for g in range(plan.gpus)
    )
    nodes = ()
    if host is not None:
        held = host_memory(plan, in_flight, apart)
        nodes = tuple(NodeResult(n, b, plan.host.memory_bytes) for n, b in sorted(held.items()))
    used = [busy[g] for g in range(plan.gpus) if plan.stages_on(g)]
    size = int(plan.model.get("micro_batch", 1))
    return SimResult(
        schedule=name,
        micro_batches=m,
        micro_batch_size=size,
        steps=steps,
        step_time_s=step_time,
        samples_per_s=plan.replicas * m * size / step_time if step_time > 0 else 0.0,
        bubble_fraction=1.0 - sum(used) / max(len(used), 1),
        window_s=window,
        step_ends_s=tuple(ends),
        in_flight=tuple(in_flight[s.id] for s in plan.stages),
        sums_apart=tuple(sorted(apart or ())),
        gpus=gpus,
        timeline=(*run.timeline, *(host.events if host is not None else ())),
        replicas=plan.replicas,
        nodes=nodes,
    )


def lagged_step_s(plan: Plan, result: SimResult) -> float | None:
    """The step time with --offload-step lagged (`costs.host.lagged`), where some offloaded
    stage's step would then land later; None where none would (or replicas step it)."""
    if plan.replicas > 1:
        return None
    lag = lagged(plan.with_(schedule=result.schedule))
    if all(s.offload == t.offload for s, t in zip(lag.stages, plan.stages, strict=True)):
        return None
    return simulate(lag, result.schedule, result.micro_batches, result.steps).step_time_s


def offload_report(plan: Plan, result: SimResult) -> list[str]:
    """`host.offload_lines` with the simulated figures it quotes (what the schedule hides,
    the lagged step's time)."""
    if not offloaded(plan):
        return []
    hidden = cpu_step_hidden(plan, result)
    return offload_lines(plan, result, hidden, lagged_step_s(plan, result))


def cpu_step_hidden(plan: Plan, result: SimResult) -> float | None:
    """The share of the CPU's optimizer step a step does not wait for: 1 - (its step time
    less the same plan's with a free CPU step) / the longest CPU step of one GPU. None when
    nothing is stepped on the CPU."""
    cpu = max((g.cpu_step_s for g in result.gpus), default=0.0)
    if cpu <= 0:
        return None
    free = plan.with_(host=replace(plan.host, step_bandwidth=math.inf))
    base = simulate(free, result.schedule, result.micro_batches, result.steps)
    exposed = max(0.0, result.step_time_s - base.step_time_s)
    return min(1.0, max(0.0, 1.0 - exposed / cpu))
