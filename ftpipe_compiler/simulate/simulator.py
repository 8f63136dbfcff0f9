"""A discrete-event simulation of a plan under a schedule: the judge between plans.

    result = simulate(plan)                                   # the plan's own schedule
    result = simulate(plan, "gpipe", micro_batches=8, steps=4)

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
one gradient norm); under the asynchronous one every stage steps at its own pace. With replicas (data parallelism) one
replica is timed, its links and the all-reduce of each stage's gradients modelled by
`network.Network`; samples/s count every replica.

Figures (see SimResult): E_k is the time the slowest GPU finishes step k (its last S);
the step time is the mean of E_k - E_{k-1} over the last half of the steps, and busy and
bubble fractions are measured over that same window. An asynchronous pipeline never
drains between steps, so it is simulated with enough extra micro-batches after the last
measured step that no measured step includes the drain.
"""

from __future__ import annotations

from dataclasses import replace

from ftpipe_runtime.schedules import (
    SCHEDULES,
    ForwardVersions,
    ScheduleError,
    StageGraph,
    resolve_schedule,
    validate,
)

from ..errors import FtpipeError, unknown
from ..plan import Plan
from .engine import EventLoop
from .result import GpuResult, SimResult

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
) -> SimResult:
    """`weights_once=False` sends a weight read by other stages with every micro-batch, as
    the runtime did before (benchmarks compare the bytes); the runtime itself never does.
    `checked=False` leaves out `validate` of the lists: a search simulating many plans
    checks the one it keeps (the runtime checks its lists again when it starts)."""
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
        lists = sched.actions(infos, m, run_steps)
        if checked:
            validate(lists, StageGraph.of(infos, consumers), sched, m, run_steps)
    except ScheduleError as e:
        raise FtpipeError(f"schedule {name}: {e}") from None
    # A weight read by other stages goes once per version of its owner's weights, the
    # micro-batches reading each version counted by the runtime's own ForwardVersions.
    owners = {t.producer for t in plan.transfers if t.tensor in {p.name for p in plan.params}}
    gpu = {s.id: s.gpu for s in plan.stages}
    versions = {s: ForwardVersions(lists[gpu[s]], s, policies[s], m) for s in owners}
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
    )
    run.go()
    return _result(plan, run, name, m, steps, run_steps)


def _result(plan: Plan, run: EventLoop, name: str, m: int, steps: int, run_steps: int):
    """The figures of a finished run: step time over the second half of the steps (the
    first half warms the pipeline up), busy fractions and peak memory per GPU."""
    lists = run.lists
    ends = [max(run.step_end[g].get(k, 0.0) for g in lists) for k in range(steps)]
    n = steps // 2
    window = (ends[-1 - n], ends[-1]) if n else (0.0, ends[0])
    measured = range(steps - n, steps) if n else range(1)  # the steps the window holds
    step_time = (window[1] - window[0]) / max(n, 1)
    busy = {
        g: _overlap(run.busy.get(g, ()), *window) / max(window[1] - window[0], 1e-30)
        for g in range(plan.gpus)
    }
    in_flight = {s.id: run.peak[s.id] for s in plan.stages}
    gpus = tuple(
        GpuResult(
            gpu=g,
            busy_fraction=busy[g],
            peak_memory_bytes=plan.gpu_memory(g, in_flight, run.peak_deferred),
            memory_bytes=plan.memory_bytes,
            stages=tuple(s.id for s in plan.stages_on(g)),
            bytes_sent=round(sum(run.sent_in.get((g, k), 0) for k in measured) / len(measured)),
        )
        for g in range(plan.gpus)
    )
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
        gpus=gpus,
        timeline=tuple(run.timeline),
        replicas=plan.replicas,
    )


def _overlap(intervals, lo: float, hi: float) -> float:
    return sum(max(0.0, min(b, hi) - max(a, lo)) for a, b in intervals)
