"""Test helper: execute an OpGraph node by node, the proof that the graph holds the whole
computation (tests/test_trace.py).

    loss = run_graph(traced, graph, params=dict(model.named_parameters()), inputs=example)

Only the members of the graph's nodes run, in the graph's order, so a node dropped or
misordered by tracing or collapsing shows up as a wrong loss or a missing value.
"""

from __future__ import annotations

import torch
from ftpipe_runtime.spec.weights import WRAPPER_PREFIX
from torch import fx

from ftpipe_compiler.graph.exported import retarget
from ftpipe_compiler.graph.opgraph import OpGraph
from ftpipe_compiler.graph.trace import Traced


def run_graph(
    traced: Traced,
    graph: OpGraph,
    params: dict[str, torch.Tensor],
    inputs: dict[str, torch.Tensor],
    device=None,
):
    """`params` by canonical name (a wrapper's `m.` prefix is accepted); returns the loss."""
    params = {k.removeprefix(WRAPPER_PREFIX): v for k, v in params.items()}
    fx_nodes = {n.name: n for n in traced.program.graph.nodes}
    values: dict[str, object] = {}
    for name, (kind, key) in traced.placeholders.items():
        if kind == "param":
            if key in params:
                values[name] = params[key]
            else:  # buffers and lifted constants live in the program
                values[name] = _program_tensor(traced, name)
        else:
            values[name] = inputs[key]
    device = device or next(iter(inputs.values())).device
    for node in graph.nodes:
        for m in node.members:
            n = fx_nodes[m]
            args, kwargs = fx.node.map_arg((n.args, n.kwargs), lambda a: values[a.name])
            args, kwargs = retarget(args, kwargs, torch.device(device))
            values[m] = n.target(*args, **kwargs)
    return values[traced.graph.output]  # the loss op, whatever group holds it


def _program_tensor(traced: Traced, placeholder: str) -> torch.Tensor:
    program = traced.program
    for s in program.graph_signature.input_specs:
        if s.arg.name == placeholder:
            if s.kind.name == "BUFFER":
                return dict(program.named_buffers())[s.target]
            return program.constants[s.target]
    raise KeyError(placeholder)
