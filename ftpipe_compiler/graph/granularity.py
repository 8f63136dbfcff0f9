"""`layer` granularity: collapse an op graph to one node per run of a layer's ops.

graph = collapse(op_graph)     # T5-3B: 2,607 op nodes -> about 100 layer nodes
layer_runs({0: [("encoder.block.0", "T5Block"), ("encoder.block.1", "T5Block")]})
                               # {0: ["encoder.block.0-1 (T5Block)"]}: what a stage holds
"""

from __future__ import annotations

import re

from .opgraph import Edge, Node, OpGraph


def collapse(graph: OpGraph, key=None) -> OpGraph:
    """`layer` granularity: merge runs of consecutive nodes that share a layer scope.

    Runs of a topological order are merged, never scattered nodes, so the result stays
    acyclic whatever the scopes are.
    """
    key = key or layer_key
    groups: list[list[Node]] = []
    for n in graph.nodes:
        if groups and layer_key(groups[-1][0].scope) == key(n.scope):
            groups[-1].append(n)
        else:
            groups.append([n])
    where = {}
    merged = []
    for grp in groups:
        gid = grp[-1].id if len(grp) == 1 else f"{key(grp[0].scope) or 'top'}#{grp[0].id}"
        for n in grp:
            where[n.id] = gid
        last = grp[-1]
        merged.append(
            Node(
                id=gid,
                op=last.op if len(grp) == 1 else "layer",
                scope=key(grp[0].scope),
                module_type=grp[0].module_type if len(grp) == 1 else _common_type(grp),
                shape=last.shape,
                dtype=last.dtype,
                out_bytes=sum(
                    n.out_bytes
                    for n in grp
                    if any(where.get(s, s) != gid for s in graph.succs[n.id])
                    or n.id == graph.output
                ),
                params=tuple(dict.fromkeys(p for n in grp for p in n.params)),
                inputs=tuple(dict.fromkeys(i for n in grp for i in n.inputs)),
                requires_grad=any(n.requires_grad for n in grp),
                members=tuple(m for n in grp for m in n.members),
                flops=sum(n.flops for n in grp),
                bytes_moved=sum(n.bytes_moved for n in grp),
                fwd_s=sum(n.fwd_s for n in grp),
                bwd_s=sum(n.bwd_s for n in grp),
                wgrad_s=sum(n.wgrad_s for n in grp),
                recompute_s=sum(n.recompute_s for n in grp),
                act_bytes=sum(n.act_bytes for n in grp),
            )
        )
    weights: dict[tuple[str, str], int] = {}
    for e in graph.edges:
        s, d = where[e.src], where[e.dst]
        if s != d:
            weights[(s, d)] = weights.get((s, d), 0) + e.bytes
    edges = tuple(Edge(s, d, b) for (s, d), b in weights.items())
    out = graph.with_nodes(merged, edges=edges, output=where[graph.output], granularity="layer")
    out.validate()
    return out


def layer_key(scope: str, deeper: int = 0) -> str:
    """The scope of the repeated layer a node belongs to; other scopes are kept to 2 parts.

    `layer_key("encoder.block.3.layer.0.SelfAttention")` -> "encoder.block.3";
    `deeper=2` keeps two more parts: "encoder.block.3.layer.0" (a sub-layer).
    """
    parts = scope.split(".") if scope else []
    for i, p in enumerate(parts):
        if p.isdigit():
            return ".".join(parts[: i + 1 + deeper])
    return ".".join(parts[:2])


def sublayer_key(scope: str) -> str:
    """'encoder.block.3.layer.0.SelfAttention.q' -> 'encoder.block.3.layer.0'."""
    return layer_key(scope, deeper=2)


def _common_type(grp) -> str:
    types = {n.module_type for n in grp}
    return types.pop() if len(types) == 1 else "mixed"


def layer_runs(held: dict[int, list[tuple[str, str]]]) -> dict[int, list[str]]:
    """Per stage, its (layer key, module type) in order, in words: numbered runs merged
    (`encoder.block.0-2 (T5Block)`), `(part)` where a layer is split between stages."""
    owners: dict[str, set[int]] = {}
    for sid, layers in held.items():
        for key, _ in layers:
            owners.setdefault(key, set()).add(sid)
    out = {}
    for sid, layers in held.items():
        runs: list[list] = []  # [prefix, first, last, type, part]
        for key, mtype in layers:
            part = len(owners[key]) > 1
            m = re.fullmatch(r"(.*\.)(\d+)", key)
            if (
                m
                and runs
                and not part
                and not runs[-1][4]
                and runs[-1][0] == m.group(1)
                and runs[-1][3] == mtype
                and runs[-1][2] == int(m.group(2)) - 1
            ):
                runs[-1][2] += 1
                continue
            if m:
                runs.append([m.group(1), int(m.group(2)), int(m.group(2)), mtype, part])
            else:
                runs.append([key or "top level", None, None, mtype, part])
        out[sid] = [_words(*r) for r in runs]
    return out


def _words(prefix, first, last, mtype, part) -> str:
    if first is None:
        name = prefix
    elif first == last:
        name = f"{prefix}{first}"
    else:
        name = f"{prefix}{first}-{last}"
    return name + (f" ({mtype})" if mtype else "") + (" (part)" if part else "")
