"""The costed graph of a partly frozen model, derived without tracing again.

    units = graph_units(graph)                        # parameters freezing with each layer
    g = frozen_graph(graph, frozenset(units[0]))      # layer 0 frozen: no dW, dX only where needed
    g = cached_graph(g, units, read=1, write=None, s_per_byte=1e-9)   # AutoCache's reads
    boundary_bytes(g, units, 1)                       # what leaves the frozen prefix

Why not `costed_graph(freeze=...)` (costs/profilers.py)? That traces and costs the model
built frozen, once per run; the elastic planner and `compile --freeze-training` need the
graph for every count of frozen layers, so they derive it from the trainable graph with
the same cost rule (`costs.analytic.weight_share`); tests/planner/test_elastic.py checks
the two give the same graph.
"""

from __future__ import annotations

from dataclasses import replace

from ftpipe_runtime.freeze.layers import layer_units

from ..costs.analytic import weight_share
from ..errors import FtpipeError
from ..graph.opgraph import OpGraph

__all__ = ["boundary_bytes", "cached_graph", "frozen_graph", "graph_units"]


def graph_units(graph: OpGraph) -> list[list[str]]:
    """The parameters that freeze with each layer (`freezing.layer_units`), in execution
    order: a parameter's place is its first reader's."""
    order = sorted(graph.owner, key=lambda p: graph.index[graph.owner[p]])
    return layer_units([p for p in order if graph.param[p].dtype.startswith(("float", "bfl"))])


def frozen_graph(graph: OpGraph, frozen: frozenset[str]) -> OpGraph:
    """The costed op graph with `frozen` parameters frozen: a node needs a gradient only if
    it reads a trainable parameter or a node that needs one (tracing's rule); its backward
    keeps only the input-gradient part it still needs and the weight-gradient part of
    trainable weights (the split of `costs.weight_share`); a node without gradient keeps
    no activations and is not recomputed."""
    params = tuple(replace(p, trainable=p.trainable and p.name not in frozen) for p in graph.params)
    g = replace(graph, params=params)
    needs: dict[str, bool] = {}
    nodes = []
    for n in graph.nodes:
        share = weight_share(graph, n)
        dx = any(needs[p] for p in graph.preds[n.id])
        dw = any(g.param[p].trainable for p in n.params)
        needs[n.id] = n.requires_grad and (dx or dw)
        bwd = n.bwd_s * ((1 - share) * dx + share * dw) if needs[n.id] else 0.0
        nodes.append(
            replace(
                n,
                requires_grad=needs[n.id],
                bwd_s=bwd,
                wgrad_s=n.bwd_s * share if needs[n.id] and dw else 0.0,
                act_bytes=n.act_bytes if needs[n.id] else 0,
                recompute_s=n.recompute_s if needs[n.id] else 0.0,
            )
        )
    return g.with_nodes(nodes)


def _prefix(graph: OpGraph, units, layers: int) -> tuple[set[str], list[str]]:
    """(the nodes of the frozen prefix of `layers` layers, those whose output leaves it)."""
    if layers >= len(units):
        raise FtpipeError("the whole model cannot be frozen")
    first = min(graph.index[graph.owner[p]] for p in units[layers])
    inside = {n.id for n in graph.nodes[:first] if not n.requires_grad}
    boundary = [i for i in inside if any(s not in inside for s in graph.succs[i])]
    return inside, boundary


def cached_graph(
    graph: OpGraph, units, read: int | None, write: int | None, s_per_byte: float
) -> OpGraph:
    """A frozen graph whose first `read` layers are read from the cache (their boundary
    costs `s_per_byte` per byte, the rest of them nothing) and whose boundary after `write`
    layers is written to it (the same cost again)."""
    fwd = {n.id: n.fwd_s for n in graph.nodes}
    if read:
        inside, boundary = _prefix(graph, units, read)
        for i in inside:
            fwd[i] = 0.0
        for i in boundary:
            fwd[i] = graph.node[i].out_bytes * s_per_byte
    if write:
        for i in _prefix(graph, units, write)[1]:
            fwd[i] += graph.node[i].out_bytes * s_per_byte
    return graph.with_nodes(replace(n, fwd_s=fwd[n.id]) for n in graph.nodes)


def boundary_bytes(graph: OpGraph, units, layers: int) -> int:
    """Bytes of one micro-batch leaving the frozen prefix of `layers` layers."""
    return sum(graph.node[i].out_bytes for i in _prefix(graph, units, layers)[1])
