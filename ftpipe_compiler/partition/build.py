"""From a node -> stage and stage -> GPU assignment to a Plan with every figure filled in.

    plan = build_plan(problem, stage_of={"linear": 0, ...}, gpu_of={0: 0, 1: 1}, partitioner="mixed")

Every partitioner ends here, so the figures of competing plans are computed one way.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, replace

from ftpipe_runtime.schedules import StageInfo, with_chunks

from ..costs.formulas import optimizer_step_s
from ..errors import FtpipeError
from ..graph.opgraph import OpGraph
from ..plan import Plan, PlanParam, Stage, Transfer
from .indexed import lowest_first
from .problem import Problem
from .remat import rematerialised


def build_plan(
    problem: Problem,
    stage_of: dict[str, int],
    gpu_of: dict[int, int],
    partitioner: str,
    search_seconds: float = 0.0,
) -> Plan:
    """Turn a node -> stage and stage -> GPU assignment into a Plan (stages renumbered)."""
    graph = problem.graph
    missing = [n.id for n in graph.nodes if n.id not in stage_of]
    if missing:
        raise FtpipeError(f"{partitioner}: {len(missing)} nodes have no stage (e.g. {missing[0]})")
    cut = _cut(problem, stage_of, gpu_of, partitioner)
    transfers = _transfers(cut)
    stages = _forward_only(_stages(problem, cut), transfers, graph, cut.loss_stage)
    return Plan(
        partitioner=partitioner,
        remat_saved_bytes=_remat_saved(cut),
        gpus=problem.gpus,
        schedule=problem.schedule,
        micro_batches=problem.micro_batches,
        optimizer=problem.optimizer,
        bandwidth=problem.bandwidth,
        latency_s=problem.hardware.link_latency_s,
        memory_bytes=problem.capacity,
        reserve=problem.hardware.memory_reserve,
        host=problem.hardware.host,
        stages=tuple(stages),
        transfers=transfers,
        params=_params(problem, cut),
        loss_stage=cut.loss_stage,
        lower_bound_s=problem.lower_bound(),
        search_seconds=search_seconds,
        model={
            **graph.meta,
            "spec": graph.model,
            "hardware": problem.hardware.name,
            "granularity": graph.granularity,
            "profile": graph.profile,
            "inputs": {i.name: [list(i.shape), i.dtype] for i in graph.inputs},
        },
    )


@dataclass
class _Cut:
    """The assignment with stages renumbered topologically and what crosses between them."""

    graph: OpGraph
    sid: dict[str, int]  # node -> stage (renumbered)
    gpu: dict[int, int]  # stage -> GPU
    depth: dict[int, int]  # stage -> longest path to a last stage
    loss_stage: int
    copies: dict[int, list[str]]  # stage -> nodes it recomputes instead of receiving
    readers: dict[str, list[int]]  # parameter -> stages reading it, the owner first
    consumers: dict[str, set[int]]  # node -> other stages it is sent to
    readers_of: dict[str, set[int]]  # the same, counting the stages that recompute it
    shared: list  # parameters read by several stages: sent by the owner

    @property
    def members(self) -> dict[int, list[str]]:
        out: dict[int, list[str]] = {s: [] for s in self.gpu}
        for n in self.graph.nodes:
            out[self.sid[n.id]].append(n.id)
        return out


def _cut(problem: Problem, stage_of, gpu_of, partitioner: str) -> _Cut:
    graph = problem.graph
    # Cheap tensors computed from inputs and weights alone: recomputed where read, not sent.
    copied = rematerialised(graph, stage_of, problem.bandwidth) if problem.rematerialise else {}
    # Stage graph and a deterministic topological numbering. Ties keep the caller's order, so
    # stages a Assignment numbered topologically keep their numbers (and parameters their owners).
    succ: dict[int, set[int]] = {stage_of[n.id]: set() for n in graph.nodes}
    for e in graph.edges:
        a, b = stage_of[e.src], stage_of[e.dst]
        if a != b and e.src not in copied.get(b, ()):
            succ[a].add(b)
    order = lowest_first(succ)
    if order is None:
        raise FtpipeError(f"{partitioner} produced a cyclic stage graph")
    renum = {old: new for new, old in enumerate(order)}
    sid = {n: renum[s] for n, s in stage_of.items()}
    copies = {renum[s]: sorted(ids, key=graph.index.get) for s, ids in copied.items()}
    readers = _param_readers(graph, sid, copies)
    after = {renum[a]: {renum[b] for b in bs} for a, bs in succ.items()}
    for r in readers.values():  # a weight's readers wait for its owner (the lowest reader)
        after[r[0]].update(r[1:])
    depth = {s: 0 for s in range(len(order))}
    for s in reversed(range(len(order))):  # every edge goes to a higher stage now
        depth[s] = max((depth[t] + 1 for t in after[s]), default=0)
    consumers: dict[str, set[int]] = {}
    readers_of: dict[str, set[int]] = {}
    for e in graph.edges:
        if sid[e.src] != sid[e.dst]:
            readers_of.setdefault(e.src, set()).add(sid[e.dst])
            if e.src not in copied.get(stage_of[e.dst], ()):
                consumers.setdefault(e.src, set()).add(sid[e.dst])
    return _Cut(
        graph=graph,
        sid=sid,
        gpu={s: gpu_of[order[s]] for s in range(len(order))},
        depth=depth,
        loss_stage=sid[graph.output],
        copies=copies,
        readers=readers,
        consumers=consumers,
        readers_of=readers_of,
        shared=[p for p in graph.params if len(readers.get(p.name, ())) > 1],
    )


def _param_readers(graph: OpGraph, sid, copies) -> dict[str, list[int]]:
    """Parameter -> the stages reading it (recomputed copies too), sorted: the owner first."""
    readers: dict[str, list[int]] = {}
    runs = [(sid[n.id], n) for n in graph.nodes]
    runs += [(s, graph.node[i]) for s, ids in copies.items() for i in ids]
    for s, n in runs:
        for p in n.params:
            readers.setdefault(p, [])
            if s not in readers[p]:
                readers[p].append(s)
    for r in readers.values():
        r.sort()
    return readers


def _stages(problem: Problem, cut: _Cut) -> list[Stage]:
    graph, readers = cut.graph, cut.readers
    infos = with_chunks(
        StageInfo(s, cut.gpu[s], cut.depth[s], s == cut.loss_stage) for s in range(len(cut.gpu))
    )
    input_bytes = {i.name: i.bytes for i in graph.inputs}
    trainable = {p.name: p.trainable and not p.frozen for p in graph.params}  # stepped
    stages = []
    for s, ids in cut.members.items():
        mine = cut.copies.get(s, [])
        local = set(ids) | set(mine)
        nodes = [graph.node[i] for i in (*ids, *mine)]
        ins = sorted(
            {p for i in ids for p in graph.preds[i] if p not in local}, key=graph.index.get
        )
        got = [p for p in cut.shared if s in readers[p.name][1:]]
        model_inputs = tuple(dict.fromkeys(x for n in nodes for x in n.inputs))
        params = tuple(
            p for p in dict.fromkeys(p for n in nodes for p in n.params) if readers[p][0] == s
        )
        owned = [p for p, r in readers.items() if r[0] == s]
        reads = Counter(p for n in nodes for p in n.params)
        stages.append(
            Stage(
                id=s,
                gpu=cut.gpu[s],
                nodes=tuple(ids),
                fwd_s=sum(n.fwd_s for n in nodes),
                bwd_s=sum(n.bwd_s for n in nodes),
                wgrad_s=sum(n.wgrad_s for n in nodes),
                recompute_s=sum(n.recompute_s for n in nodes),
                recompute=problem.policy(infos[s]).recompute,
                depth=cut.depth[s],
                params=params,
                inputs=(*ins, *(p.name for p in got)),
                outputs=(
                    *(i for i in ids if i in cut.consumers),
                    *(p.name for p in cut.shared if readers[p.name][0] == s),
                ),
                model_inputs=model_inputs,
                input_bytes=sum(graph.node[i].out_bytes for i in ins)
                + sum(p.bytes for p in got)
                + sum(input_bytes[x] for x in model_inputs),
                act_bytes=sum(n.act_bytes for n in nodes),
                copies=tuple(mine),
                reread=tuple(p for p, k in reads.items() if k > 1),
                step_s=optimizer_step_s(
                    (problem.static_bytes[p] for p in owned if trainable[p]), problem.hardware
                ),
            )
        )
    return stages


def _transfers(cut: _Cut) -> tuple[Transfer, ...]:
    """Activations to the stages that read them, then shared parameters from their owner."""
    graph, readers = cut.graph, cut.readers
    activations = tuple(
        Transfer(
            tensor=t,
            producer=cut.sid[t],
            consumers=tuple(sorted(c)),
            shape=graph.node[t].shape,
            dtype=graph.node[t].dtype,
            bytes=graph.node[t].out_bytes,
            requires_grad=graph.node[t].requires_grad,
        )
        for t, c in sorted(cut.consumers.items(), key=lambda kv: graph.index[kv[0]])
    )
    weights = tuple(
        Transfer(
            tensor=p.name,
            producer=readers[p.name][0],
            consumers=tuple(readers[p.name][1:]),
            shape=p.shape,
            dtype=p.dtype,
            bytes=p.bytes,
            requires_grad=p.trainable,
        )
        for p in cut.shared
    )
    return activations + weights


def _params(problem: Problem, cut: _Cut) -> tuple[PlanParam, ...]:
    return tuple(
        PlanParam(
            name=p.name,
            shape=p.shape,
            dtype=p.dtype,
            bytes=p.bytes,
            static_bytes=problem.static_bytes[p.name],
            trainable=p.trainable,
            aliases=p.aliases,
            stages=tuple(cut.readers.get(p.name, ())[:1]),
            frozen=p.frozen,
        )
        for p in cut.graph.params
    )


def _remat_saved(cut: _Cut) -> int:
    """Per micro-batch: what no longer crosses to a GPU (and its gradient back)."""
    saved = 0
    gpu = cut.gpu
    for t, cs in cut.readers_of.items():
        n = cut.graph.node[t]
        gone = {gpu[c] for c in cs} - {gpu[c] for c in cut.consumers.get(t, ())}
        gone -= {gpu[cut.sid[t]]}
        saved += n.out_bytes * (2 if n.requires_grad else 1) * len(gone)
    return saved


def _forward_only(stages: list, transfers, graph, loss_stage: int) -> list:
    """Mark the stages that need no backward (the runtime's `frozen.forward_only_stages`):
    nothing trainable in them, no gradient across their borders, not the loss stage."""
    grad = {t.tensor for t in transfers if t.requires_grad}
    trains = {p.name for p in graph.params if p.trainable}
    return [
        replace(st, forward_only=True)
        if st.id != loss_stage
        and not (set(st.inputs) | set(st.outputs)) & grad
        and not set(st.params) & trains
        else st
        for st in stages
    ]
