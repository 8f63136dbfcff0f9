"""What each stage of a plan offloads to host memory, or shards across its replicas: the
planner's choice, per stage.

    plan = choose_offload(plan, "auto")    # the least offload that makes every GPU fit
    plan = choose_offload(plan, "optimizer")   # forced: every trainable stage's optimizer
    plan = choose_offload(plan, "none", shard="auto")   # replicated: shard where a GPU needs it

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

Where its gradients sum (`Offload.gradients`): an offloaded stage streams each micro-batch's
gradients to the host (`host`: the GPU holds no sum), unless summing them on the GPU and
copying the sum once a step (`device`) puts fewer bytes on the link — m x the weights'
bytes against the sum's, so in bf16 with fp32 sums when m > 2 — and its GPU still fits with
the sums (4 bytes an element): then it sums on the device (`_sums_on_device`, after the
offload above, stages freeing the most link bytes first). Not with replicas: their
all-reduce reads the gradients where the masters are, so the runtime streams them.

Sharding (`--shard-optimizer`, `SHARD_MODES`; ZeRO-1, `ftpipe_runtime.train.zero`): with d
replicas a stage may keep 1/d of its fp32 masters and optimizer state on each, its gradients
reduce-scattered and its new weights all-gathered instead of all-reduced — no host traffic,
as many bytes on the replicas' ring in fp32 and fewer in 16 bits. Under `auto` it is the
cheapest choice of all (cost 0), so a GPU over its memory shards its stages before it
offloads anything, and a stage offloaded later stops sharding (the runtime does not run
both). `always` shards every stage that trains. Never where the runtime refuses it
(`shard_refusal`): one replica, an update rule whose state is per matrix (Adafactor), a
package that switches to shorter pipelines as it freezes layers.
"""

from __future__ import annotations

from dataclasses import replace

from ftpipe_runtime.train.zero import SHARDABLE

from ..costs.host import Host, Offload, lagged, optimizer_times
from ..plan import Plan

__all__ = ["MODES", "SHARD_MODES", "choose_offload", "searches", "shard_refusal"]

MODES = {
    "auto": "offload per stage only what keeps a GPU from fitting, cheapest first",
    "none": "offload nothing (the plans of ftpipe before offload)",
    "optimizer": "every trainable stage's fp32 masters and optimizer state on the host, "
    "the optimizer step on the CPU",
    "activations": "every stage's saved activations (or inputs kept for recompute) on the "
    "host, fetched back one micro-batch ahead",
}


SHARD_MODES = {
    "auto": "shard a stage's optimizer state across its replicas only where a GPU needs it",
    "none": "never shard (every replica keeps all of its stages' masters and state)",
    "always": "shard every trainable stage's masters and optimizer state across its replicas",
}


def shard_refusal(optimizer: str, *, freezing: bool = False) -> str | None:
    """Why no stage may shard its optimizer state under `optimizer` (None: it may): the
    runtime's refusals (`ftpipe_runtime.job.prepare`)."""
    if optimizer.lower() not in SHARDABLE:
        return (
            f"the optimizer {optimizer} keeps its state per matrix, so a replica cannot step "
            f"a slice of it; sharding needs --optimizer {' or '.join(SHARDABLE)}"
        )
    if freezing:
        return "a package that freezes layers (--freeze-training) does not shard"
    return None


def searches(mode: str, host: Host) -> tuple[str, ...]:
    """The searches `--offload mode` makes, in order, each only when the one before found no
    plan that fits: auto searches without offload first, and only that where the device is
    the host (a CPU rank: offloading frees nothing)."""
    if mode != "auto":
        return (mode,)
    return ("none",) if host.device_is_host else ("none", "auto")


def choose_offload(plan: Plan, mode: str, shard: str = "auto", *, step: str = "exact") -> Plan:
    """`plan` with each stage's offload chosen by `mode`, and its sharding by `shard` where
    the plan has replicas (see the module doc; the caller has checked `shard_refusal`);
    `step` lagged: the offloaded steps of a schedule whose actions read the weights as they
    are (FTPipe's) land at the stage's next step (`Offload.step`)."""
    plan = _chosen(plan, mode, shard)
    return lagged(plan) if step == "lagged" else plan


def _chosen(plan: Plan, mode: str, shard: str) -> Plan:
    params = {p.name: p for p in plan.params}
    trains = {s.id: any(params[n].trainable for n in s.params) for s in plan.stages}
    shards = plan.replicas > 1 and shard != "none"
    if mode == "none" and not shards:
        return plan
    chosen = {s.id: s.offload for s in plan.stages}
    sharded = {s.id: s.shard_optimizer for s in plan.stages}
    if mode in ("optimizer", "activations"):
        chosen = {
            s.id: Offload(
                optimizer=mode == "optimizer" and trains[s.id],
                activations=mode == "activations" and not s.forward_only,
            )
            for s in plan.stages
        }
    if shards and shard == "always":
        sharded = {i: trains[i] and not chosen[i].optimizer for i in sharded}
    plan = _with(plan, chosen, sharded, mode, shard)
    if mode != "auto" and not (shards and shard == "auto"):
        return _sums_on_device(plan)
    kinds = (("optimizer", "activations") if mode == "auto" else ()) + ("shard",) * shards
    for g in range(plan.gpus):
        if plan.gpu_memory(g) <= plan.memory_bytes:
            continue
        options = _options(plan, g, trains, kinds)
        for s, kind in sorted(options, key=lambda o: _cost(plan, *o)):
            if kind == "shard":
                sharded[s] = True
            else:  # offloaded, its optimizer state is whole on the host: not sharded
                chosen[s] = replace(chosen[s], **{kind: True})
                sharded[s] = sharded[s] and kind != "optimizer"
            plan = _with(plan, chosen, sharded, mode, shard)
            if plan.gpu_memory(g) <= plan.memory_bytes:
                break
    return _sums_on_device(plan)


def _sums_on_device(plan: Plan) -> Plan:
    """`plan` with each offloaded stage's gradients summed on the GPU where that puts fewer
    bytes on the host link and the GPU still fits (see the module doc)."""
    if plan.replicas > 1:
        return plan
    m = plan.micro_batches
    for g in range(plan.gpus):
        if plan.gpu_memory(g) > plan.memory_bytes:
            continue
        saved = {}
        for s in plan.stages_on(g):
            if s.offload.optimizer and not s.offload.sums_on_device:
                streamed = optimizer_times(plan, s, plan.host.share(1)).grad_bytes * m
                summed = optimizer_times(plan, _summing(s), plan.host.share(1)).sum_bytes
                if summed < streamed:
                    saved[s.id] = streamed - summed
        for sid in sorted(saved, key=lambda i: -saved[i]):
            tried = plan.with_(stages=tuple(_summing(s) if s.id == sid else s for s in plan.stages))
            if tried.gpu_memory(g) <= tried.memory_bytes:
                plan = tried
    return plan


def _summing(s):
    """Stage s summing its offloaded gradients on the device."""
    return replace(s, offload=replace(s.offload, gradients="device"))


def _with(plan: Plan, chosen: dict[int, Offload], sharded: dict, mode: str, shard: str) -> Plan:
    stages = tuple(
        replace(s, offload=chosen[s.id], shard_optimizer=sharded[s.id]) for s in plan.stages
    )
    said = {"offload": mode} | ({"shard_optimizer": shard} if plan.replicas > 1 else {})
    return plan.with_(stages=stages, model={**plan.model, **said})


def _options(plan: Plan, g: int, trains: dict, kinds) -> list[tuple[int, str]]:
    """What GPU g's stages could still offload or shard (`kinds`) and would free memory by."""
    out = []
    for s in plan.stages_on(g):
        free = trains[s.id] and not (s.shard_optimizer or s.offload.optimizer)
        if "shard" in kinds and free and _freed(plan, s, "shard") > 0:
            out.append((s.id, "shard"))
        if "optimizer" in kinds and trains[s.id] and not s.offload.optimizer:
            out.append((s.id, "optimizer"))
        if (
            "activations" in kinds
            and not s.forward_only
            and not s.offload.activations
            and _freed(plan, s, "activations")
        ):
            out.append((s.id, "activations"))
    return out


def _more(s, kind: str):
    """Stage s offloading (or sharding) `kind` too."""
    if kind == "shard":
        return replace(s, shard_optimizer=True)
    return replace(s, offload=replace(s.offload, **{kind: True}), shard_optimizer=False)


def _freed(plan: Plan, s, kind: str) -> int:
    """GPU bytes stage s stops holding throughout when it offloads (or shards) `kind` too."""
    held, _ = plan.stage_memory(s)
    after, _ = plan.stage_memory(_more(s, kind))
    return int(held - after)


def _cost(plan: Plan, stage: int, kind: str) -> float:
    """Host-link and CPU seconds per step per GPU byte freed (this GPU alone on its link);
    sharding none: it sends no more than the all-reduce it replaces (its all-gather after
    the step the simulation charges)."""
    s = next(x for x in plan.stages if x.id == stage)
    freed = _freed(plan, s, kind)
    if freed <= 0:
        return float("inf")
    if kind == "shard":
        return 0.0
    m = plan.micro_batches
    if kind == "activations":
        policy = plan.policies[s.id]
        kept = s.input_bytes if policy.recompute else s.act_bytes
        return 2 * m * kept / plan.host.share(1)[0] / freed
    return optimizer_times(plan, s, plan.host.share(1)).per_step_s(m) / freed
