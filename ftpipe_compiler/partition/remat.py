"""Rematerialise instead of send: a cheap producer subgraph is copied into each stage that
reads its output, so the output no longer crosses between stages.

    copies = rematerialised(graph, stage_of, bandwidth)   # stage -> node ids it recomputes

A tensor one stage makes and another reads can be recomputed by the reader when everything
it comes from is a model input or a parameter: no activation of the model, no random
numbers. T5's relative position bias (an embedding of bucketed distances, plus the attention
mask), attention masks and rotary tables are such tensors. The reader recomputes one when,
by the cost model, that subgraph's forward and backward take less time than the tensor's
journey (bytes / bandwidth, twice when its gradient comes back). A parameter the copies
read reaches the reading stage like any weight read by several stages (once per version of
its owner's weights), and its gradient comes back summed, so training is unchanged.
"""

from __future__ import annotations

from ..graph.opgraph import OpGraph

__all__ = ["MAX_COPY_NODES", "rematerialised"]

MAX_COPY_NODES = 256  # a subgraph larger than this is not looked at further (cost and time)
_RANDOM = ("dropout", "rand", "bernoulli", "normal", "uniform", "multinomial", "exponential")


def rematerialised(
    graph: OpGraph, stage_of: dict[str, int], bandwidth: float
) -> dict[int, set[str]]:
    """Per stage, the nodes of other stages it recomputes instead of receiving their outputs."""
    preds, node, param = graph.preds, graph.node, graph.param
    readers: dict[str, set[int]] = {}  # node -> other stages reading it
    for e in graph.edges:
        if stage_of[e.src] != stage_of[e.dst]:
            readers.setdefault(e.src, set()).add(stage_of[e.dst])
    reads: dict[int, set[str]] = {}  # stage -> parameters its own nodes read
    for n in graph.nodes:
        reads.setdefault(stage_of[n.id], set()).update(n.params)
    copies: dict[int, set[str]] = {}
    for t in sorted(readers, key=graph.index.get):
        n = node[t]
        journey = n.out_bytes / bandwidth * (2 if n.requires_grad else 1)
        closure = _closure(t, preds, node, journey)
        if closure is None:
            continue
        for s in sorted(readers[t]):
            new = {x for x in closure if stage_of[x] != s}
            # Weights the copies read come to the stage (and their gradients go back):
            # counted as if with every micro-batch (they go once per version: a bound).
            weights = {p for x in new for p in node[x].params} - reads.get(s, set())
            cost = sum(node[x].fwd_s + node[x].bwd_s for x in new)
            cost += 2 * sum(param[p].bytes for p in weights) / bandwidth
            if cost < journey:
                copies.setdefault(s, set()).update(new)
    return copies


def _closure(t: str, preds, node, budget: float) -> set[str] | None:
    """`t` and every node it comes from, or None when that draws random numbers, or costs
    `budget` seconds or more to compute, or grows past MAX_COPY_NODES (it reads an
    activation of the model: the whole model before it would come along)."""
    seen, todo, cost = {t}, [t], 0.0
    while todo:
        x = todo.pop()
        n = node[x]
        if any(word in name for name in (n.op, *n.members) for word in _RANDOM):
            return None
        cost += n.fwd_s + n.bwd_s
        if cost >= budget or len(seen) > MAX_COPY_NODES:
            return None
        for p in preds[x]:
            if p not in seen:
                seen.add(p)
                todo.append(p)
    return seen
