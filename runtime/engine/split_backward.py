"""A backward in two passes: input gradients now (B), weight gradients later (W).

    later = backward_input(roots, grads, inputs, params)   # inputs' .grad set, nothing else
    ...                                                     # other work; the graph is kept
    backward_weight(later)                                  # params' .grad accumulated; freed
    backward_weight(later, add)                             # or add(param, grad) for each

Zero-bubble schedules (Qi et al., ICLR'24) run B on the critical path and W when the GPU
would idle. B differentiates the roots with respect to the stage inputs only, keeping the
autograd graph; W must not redo B's work (for a stack of layers, the gradient flowing back
through every later layer), so B also records, for each parameter, where its gradient leaves
the part of the graph B ran: the *frontier* nodes, those on a path from the roots to an
input with an edge that leads to the parameter without going through such a path (the
matmul whose weight it is). A pre-hook captures the gradient each frontier node receives
during B. W then restarts autograd at those nodes with those gradients, asking only for
the parameters, so it computes only the parameter side: each weight-gradient matmul once.

Parameters whose frontiers overlap form one group, differentiated in one call; a pre-hook
pins every frontier node of the group to the gradient it had in B, so paths from one
frontier to another (a weight read twice in the stage: a tied embedding and head) cannot
count a contribution twice, and the nodes B ran between them are silenced (given no
gradient, autograd's formulas skip their work) instead of being computed again.
Roots whose graph reaches no input (the first stage, fed ids; a parameter sent to other
stages whose gradient came back) are differentiated wholly in W. The result equals one
`torch.autograd.backward` up to the order of summation. The graph, the captured gradients
and the saved activations are released when W returns and its record is dropped.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch.autograd.graph import GradientEdge

__all__ = ["Deferred", "backward_input", "backward_weight"]


@dataclass
class _Group:
    frontier: list = field(default_factory=list)  # autograd nodes B ran
    roots: list = field(default_factory=list)  # (root tensor, its gradient): wholly in W
    params: list = field(default_factory=list)
    silent: list = field(default_factory=list)  # nodes B ran between frontier nodes


@dataclass
class Deferred:
    """What a weight pass needs: parameter groups and the gradients captured during B."""

    groups: list[_Group]
    captured: dict = field(default_factory=dict)  # frontier node -> its grad_outputs in B
    # The graph held until W: a custom Function's node (the fused loss's) is reached from
    # Python through its ctx, which holds it weakly (torch 2.11: dead once the roots are
    # dropped); a view's node holds its root's node strongly, and no tensor.
    anchors: list = field(default_factory=list)


def node_of(t: torch.Tensor):
    """The autograd node a tensor's gradient enters: its grad_fn, or a leaf's accumulator."""
    if t.grad_fn is not None:
        return t.grad_fn
    return t.view_as(t).grad_fn.next_functions[0][0]  # a view exposes the leaf's accumulator


def backward_input(roots, grads, inputs, params) -> Deferred:
    """Accumulate d(roots)/d(inputs) into the inputs' .grad; return what W needs."""
    pairs = [
        (r, torch.ones_like(r) if g is None else g) for r, g in zip(roots, grads) if r.requires_grad
    ]
    inputs = [x for x in inputs if x.requires_grad]
    params = [p for p in params if p.requires_grad]
    nodes = {}  # root node -> its root tensors
    for r, g in pairs:
        nodes.setdefault(node_of(r), []).append((r, g))
    parents, reach = _walk(list(nodes), {node_of(x) for x in inputs})
    groups = _groups(params, parents, reach, nodes)
    later = Deferred(groups, anchors=[r.view_as(r).grad_fn for r, _ in pairs])
    frontier = {n for grp in groups for n in grp.frontier}
    hooks = [n.register_prehook(_capture(later.captured, n)) for n in frontier]
    try:
        feeding = [(r, g) for n, rs in nodes.items() if reach[n] for r, g in rs]
        if inputs and feeding:
            got = torch.autograd.grad(
                [r for r, _ in feeding],
                inputs,
                [g for _, g in feeding],
                retain_graph=True,
                allow_unused=True,
            )
            for x, g in zip(inputs, got):
                if g is not None:
                    x.grad = g if x.grad is None else x.grad + g
    finally:
        for h in hooks:
            h.remove()
    return later


def backward_weight(later: Deferred, add=None) -> None:
    """Accumulate the parameters' gradients into their .grad, or hand each to `add(param,
    grad)` (the run's: into its fp32 master under mixed precision); `later` is spent."""
    for grp in later.groups:
        outs, gouts = [], []
        for n in grp.frontier:
            for i, g in enumerate(later.captured.get(n, ())):
                if g is not None:
                    outs.append(GradientEdge(n, i))
                    gouts.append(g)
        for r, g in grp.roots:
            outs.append(r)
            gouts.append(g)
        if not outs:
            continue
        pins = [
            n.register_prehook(_pinned(later.captured[n]))
            for n in grp.frontier
            if n in later.captured
        ]
        pins += [n.register_prehook(_silenced) for n in grp.silent]
        try:
            got = torch.autograd.grad(outs, grp.params, gouts, retain_graph=True, allow_unused=True)
        finally:
            for h in pins:
                h.remove()
        for p, g in zip(grp.params, got):
            if g is None:
                continue
            if add is not None:
                add(p, g)
            else:
                p.grad = g if p.grad is None else p.grad + g
    later.groups.clear()
    later.captured.clear()
    later.anchors.clear()


def _walk(roots, targets):
    """(parents: node -> nodes whose gradients flow into it, reach: node -> does it lead to a
    target), over the graph below `roots`, without recursion (graphs are deep)."""
    parents: dict = {n: [] for n in roots}
    reach: dict = {}
    opened = set()
    stack = [(n, False) for n in roots]
    while stack:
        n, done = stack.pop()
        if done:  # every child finished (a child still open would close a cycle)
            kids = [c for c, _ in n.next_functions if c is not None]
            reach[n] = n in targets or any(reach[c] for c in kids)
            continue
        if n in opened:
            continue
        opened.add(n)
        stack.append((n, True))
        for c, _ in n.next_functions:
            if c is None:
                continue
            ups = parents.setdefault(c, [])
            if n not in ups:
                ups.append(n)
            if c not in opened:
                stack.append((c, False))
    return parents, reach


def _groups(params, parents, reach, root_nodes) -> list[_Group]:
    """Parameters grouped by shared sources: frontier nodes (reached in B) and roots whose
    graphs reach no input."""
    sources = {}  # param index -> set of source nodes
    for k, p in enumerate(params):
        start = node_of(p)
        if start not in parents:
            continue  # not used by the roots: no gradient, as with a full backward
        found, seen, todo = set(), {start}, [start]
        while todo:
            n = todo.pop()
            if n in root_nodes and not reach[n]:
                found.add(n)
            for up in parents[n]:
                if reach[up]:
                    found.add(up)  # B runs `up`; the parameter's gradient leaves there
                elif up not in seen:
                    seen.add(up)
                    todo.append(up)
        sources[k] = found
    # Union parameters sharing a source.
    owner: dict = {}
    link = list(range(len(params)))

    def find(k: int) -> int:
        while link[k] != k:
            link[k] = link[link[k]]
            k = link[k]
        return k

    for k, found in sources.items():
        for n in found:
            if n in owner:
                link[find(k)] = find(owner[n])
            else:
                owner[n] = k
    groups: dict[int, _Group] = {}
    nodes: dict[int, dict] = {}  # group -> its source nodes, in order (a dict as an ordered set)
    for k, found in sources.items():
        grp = groups.setdefault(find(k), _Group())
        grp.params.append(params[k])
        nodes.setdefault(find(k), {}).update(dict.fromkeys(found))
    for k, grp in groups.items():
        for n in nodes[k]:
            if n in root_nodes and not reach[n]:
                grp.roots += root_nodes[n]
            else:
                grp.frontier.append(n)
        if len(grp.frontier) > 1:
            grp.silent = _between(grp.frontier, reach)
    return list(groups.values())


def _between(frontier: list, reach: dict) -> list:
    """Nodes B ran (leading to an input) below some frontier node, frontier nodes excluded:
    W reaches them only on its way to another frontier node, whose gradient is pinned."""
    stop = set(frontier)
    seen, todo = set(), list(frontier)
    while todo:
        n = todo.pop()
        for c, _ in n.next_functions:
            if c is not None and reach.get(c) and c not in seen and c not in stop:
                seen.add(c)
                todo.append(c)
    return list(seen)


def _capture(store: dict, node):
    def hook(grad_outputs):
        store[node] = grad_outputs

    return hook


def _pinned(saved):
    return lambda grad_outputs: saved


def _silenced(grad_outputs):
    return tuple(None for _ in grad_outputs)
