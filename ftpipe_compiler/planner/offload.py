"""What each stage of a plan offloads to host memory: the planner's choice, per stage.

    plan = choose_offload(plan, "auto")    # the least offload that makes every GPU fit
    plan = choose_offload(plan, "optimizer")   # forced: every trainable stage's optimizer

`--offload` (`MODES`): `none` plans as before offload existed; `optimizer` and `activations`
offload that on every stage that has it (trainable parameters; a backward); `auto` (the
default) keeps a plan as it is when it fits and otherwise, on each GPU over its memory,
offloads one thing of one of its stages after another, cheapest first — the host-link and
CPU seconds a step would spend per GPU byte freed (`_cost`, before the simulation; host
traffic that copies overlap is counted whole) — until the GPU fits. The search does not
multiply its matrix by these choices: `compile` searches without offload first, and only when
nothing fits searches again with the partitioners told that every stage may offload
(`Problem.offload`), each of their plans then trimmed to the least offload by this rule and
simulated with the host's costs, so a plan that offloads never displaces one that need not.
"""

from __future__ import annotations

from dataclasses import replace

from ..costs.host import Host, Offload, optimizer_times
from ..plan import Plan

__all__ = ["MODES", "choose_offload", "searches"]

MODES = {
    "auto": "offload per stage only what keeps a GPU from fitting, cheapest first",
    "none": "offload nothing (the plans of ftpipe before offload)",
    "optimizer": "every trainable stage's fp32 masters and optimizer state on the host, "
    "the optimizer step on the CPU",
    "activations": "every stage's saved activations (or inputs kept for recompute) on the "
    "host, fetched back one micro-batch ahead",
}


def searches(mode: str, host: Host) -> tuple[str, ...]:
    """The searches `--offload mode` makes, in order, each only when the one before found no
    plan that fits: auto searches without offload first, and only that where the device is
    the host (a CPU rank: offloading frees nothing)."""
    if mode != "auto":
        return (mode,)
    return ("none",) if host.device_is_host else ("none", "auto")


def choose_offload(plan: Plan, mode: str) -> Plan:
    """`plan` with each stage's offload chosen by `mode` (see the module doc)."""
    if mode == "none":
        return plan
    params = {p.name: p for p in plan.params}
    trains = {s.id: any(params[n].trainable for n in s.params) for s in plan.stages}
    if mode in ("optimizer", "activations"):
        forced = {
            s.id: Offload(
                optimizer=mode == "optimizer" and trains[s.id],
                activations=mode == "activations" and not s.forward_only,
            )
            for s in plan.stages
        }
        return _with(plan, forced, mode)
    chosen = {s.id: Offload() for s in plan.stages}
    for g in range(plan.gpus):
        if plan.gpu_memory(g) <= plan.memory_bytes:
            continue
        for s, kind in sorted(_options(plan, g, trains), key=lambda o: _cost(plan, *o)):
            chosen[s] = replace(chosen[s], **{kind: True})
            plan = _with(plan, chosen, mode)
            if plan.gpu_memory(g) <= plan.memory_bytes:
                break
    return _with(plan, chosen, mode)


def _with(plan: Plan, chosen: dict[int, Offload], mode: str) -> Plan:
    stages = tuple(replace(s, offload=chosen[s.id]) for s in plan.stages)
    return plan.with_(stages=stages, model={**plan.model, "offload": mode})


def _options(plan: Plan, g: int, trains: dict) -> list[tuple[int, str]]:
    """What GPU g's stages could still offload and would free memory by."""
    out = []
    for s in plan.stages_on(g):
        if trains[s.id] and not s.offload.optimizer:
            out.append((s.id, "optimizer"))
        if not s.forward_only and not s.offload.activations and _freed(plan, s, "activations"):
            out.append((s.id, "activations"))
    return out


def _freed(plan: Plan, s, kind: str) -> int:
    """GPU bytes stage s stops holding throughout when it offloads `kind` too."""
    held, _ = plan.stage_memory(s)
    more = replace(s, offload=replace(s.offload, **{kind: True}))
    after, _ = plan.stage_memory(more)
    return int(held - after)


def _cost(plan: Plan, stage: int, kind: str) -> float:
    """Host-link and CPU seconds per step per GPU byte freed (this GPU alone on its link)."""
    s = next(x for x in plan.stages if x.id == stage)
    freed = _freed(plan, s, kind)
    if freed <= 0:
        return float("inf")
    m = plan.micro_batches
    if kind == "activations":
        policy = plan.policies[s.id]
        kept = s.input_bytes if policy.recompute else s.act_bytes
        return 2 * m * kept / plan.host.share(1)[0] / freed
    t = optimizer_times(plan, s, plan.host.share(1))
    return (m * t.grad_s + t.cpu_s + t.upload_s) / freed
