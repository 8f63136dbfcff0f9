"""From a node -> stage and stage -> GPU assignment to a Plan with every figure filled in.

    plan = build_plan(problem, stage_of={"linear": 0, ...}, gpu_of={0: 0, 1: 1}, partitioner="mixed")

Every partitioner ends here, so the figures of competing plans are computed one way.
"""

from __future__ import annotations

from dataclasses import replace

import networkx as nx
from ftpipe_runtime.schedules import StageInfo, with_chunks

from ..costs.formulas import optimizer_step_s
from ..errors import FtpipeError
from ..plan import Plan, PlanParam, Stage, Transfer
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
    # Cheap tensors computed from inputs and weights alone: recomputed where read, not sent.
    copied = rematerialised(graph, stage_of, problem.bandwidth) if problem.rematerialise else {}
    # Stage graph and a deterministic topological numbering. Ties keep the caller's order, so
    # stages a Assignment numbered topologically keep their numbers (and parameters their owners).
    sg = nx.DiGraph()
    sg.add_nodes_from(stage_of[n.id] for n in graph.nodes)
    for e in graph.edges:
        a, b = stage_of[e.src], stage_of[e.dst]
        if a != b and e.src not in copied.get(b, ()):
            sg.add_edge(a, b)
    if not nx.is_directed_acyclic_graph(sg):
        raise FtpipeError(f"{partitioner} produced a cyclic stage graph")
    order = list(nx.lexicographical_topological_sort(sg, key=lambda s: s))
    renum = {old: new for new, old in enumerate(order)}
    sid = {n: renum[s] for n, s in stage_of.items()}
    copies = {renum[s]: sorted(ids, key=graph.index.get) for s, ids in copied.items()}
    loss_stage = sid[graph.output]
    readers: dict[str, list[int]] = {}  # parameter -> stages reading it, the owner first
    runs = [(sid[n.id], n) for n in graph.nodes]
    runs += [(s, graph.node[i]) for s, ids in copies.items() for i in ids]
    for s, n in runs:
        for p in n.params:
            readers.setdefault(p, [])
            if s not in readers[p]:
                readers[p].append(s)
    for r in readers.values():
        r.sort()
    rg = nx.relabel_nodes(sg, renum)
    rg.add_edges_from((r[0], x) for r in readers.values() for x in r[1:])
    depth = {s: 0 for s in rg}
    for s in reversed(list(nx.topological_sort(rg))):
        depth[s] = max((depth[t] + 1 for t in rg.successors(s)), default=0)
    infos = with_chunks(
        StageInfo(s, gpu_of[order[s]], depth[s], s == loss_stage) for s in range(len(order))
    )

    members: dict[int, list[str]] = {s: [] for s in range(len(order))}
    for n in graph.nodes:
        members[sid[n.id]].append(n.id)
    consumers: dict[str, set[int]] = {}
    readers_of: dict[str, set[int]] = {}  # the same, counting the stages that recompute it
    for e in graph.edges:
        if sid[e.src] != sid[e.dst]:
            readers_of.setdefault(e.src, set()).add(sid[e.dst])
            if e.src not in copied.get(stage_of[e.dst], ()):
                consumers.setdefault(e.src, set()).add(sid[e.dst])
    input_bytes = {i.name: i.bytes for i in graph.inputs}
    shared = [p for p in graph.params if len(readers.get(p.name, ())) > 1]  # sent by the owner

    trainable = {p.name: p.trainable and not p.frozen for p in graph.params}  # stepped
    owned = {s: [p for p, r in readers.items() if r[0] == s] for s in members}
    stages = []
    for s, ids in members.items():
        mine = copies.get(s, [])
        local = set(ids) | set(mine)
        nodes = [graph.node[i] for i in (*ids, *mine)]
        ins = sorted(
            {p for i in ids for p in graph.preds[i] if p not in local}, key=graph.index.get
        )
        got = [p for p in shared if s in readers[p.name][1:]]
        model_inputs = tuple(dict.fromkeys(x for n in nodes for x in n.inputs))
        stages.append(
            Stage(
                id=s,
                gpu=gpu_of[order[s]],
                nodes=tuple(ids),
                fwd_s=sum(n.fwd_s for n in nodes),
                bwd_s=sum(n.bwd_s for n in nodes),
                wgrad_s=sum(n.wgrad_s for n in nodes),
                recompute_s=sum(n.recompute_s for n in nodes),
                recompute=problem.policy(infos[s]).recompute,
                depth=depth[s],
                params=tuple(
                    p
                    for p in dict.fromkeys(p for n in nodes for p in n.params)
                    if readers[p][0] == s
                ),
                inputs=(*ins, *(p.name for p in got)),
                outputs=(
                    *(i for i in ids if i in consumers),
                    *(p.name for p in shared if readers[p.name][0] == s),
                ),
                model_inputs=model_inputs,
                input_bytes=sum(graph.node[i].out_bytes for i in ins)
                + sum(p.bytes for p in got)
                + sum(input_bytes[x] for x in model_inputs),
                act_bytes=sum(n.act_bytes for n in nodes),
                copies=tuple(mine),
                step_s=optimizer_step_s(
                    (problem.static_bytes[p] for p in owned[s] if trainable[p]), problem.hardware
                ),
            )
        )
    transfers = tuple(
        Transfer(
            tensor=t,
            producer=sid[t],
            consumers=tuple(sorted(c)),
            shape=graph.node[t].shape,
            dtype=graph.node[t].dtype,
            bytes=graph.node[t].out_bytes,
            requires_grad=graph.node[t].requires_grad,
        )
        for t, c in sorted(consumers.items(), key=lambda kv: graph.index[kv[0]])
    ) + tuple(
        Transfer(
            tensor=p.name,
            producer=readers[p.name][0],
            consumers=tuple(readers[p.name][1:]),
            shape=p.shape,
            dtype=p.dtype,
            bytes=p.bytes,
            requires_grad=p.trainable,
        )
        for p in shared
    )
    params = tuple(
        PlanParam(
            name=p.name,
            shape=p.shape,
            dtype=p.dtype,
            bytes=p.bytes,
            static_bytes=problem.static_bytes[p.name],
            trainable=p.trainable,
            aliases=p.aliases,
            stages=tuple(readers.get(p.name, ())[:1]),
            frozen=p.frozen,
        )
        for p in graph.params
    )
    stages = _forward_only(stages, transfers, graph, loss_stage)
    gpu = {s: gpu_of[order[s]] for s in range(len(order))}
    saved = 0  # per micro-batch: what no longer crosses to a GPU (and its gradient back)
    for t, cs in readers_of.items():
        n = graph.node[t]
        gone = {gpu[c] for c in cs} - {gpu[c] for c in consumers.get(t, ())} - {gpu[sid[t]]}
        saved += n.out_bytes * (2 if n.requires_grad else 1) * len(gone)
    return Plan(
        partitioner=partitioner,
        remat_saved_bytes=saved,
        gpus=problem.gpus,
        schedule=problem.schedule,
        micro_batches=problem.micro_batches,
        optimizer=problem.optimizer,
        bandwidth=problem.bandwidth,
        latency_s=problem.hardware.link_latency_s,
        memory_bytes=problem.memory,
        stages=tuple(stages),
        transfers=transfers,
        params=params,
        loss_stage=loss_stage,
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
