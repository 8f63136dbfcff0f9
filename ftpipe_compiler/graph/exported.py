"""From an exported program to an OpGraph: one node per live ATen call, its scope, shape,
bytes and the parameters it reads (what `trace.trace_model` returns as `Traced.graph`).

    graph, placeholders = to_graph(spec, task, micro_batch, model, inputs, program)
    op_name(fx_node.target); describe_value(fx_node.meta["val"]); retarget(args, kwargs, dev)
"""

from __future__ import annotations

import torch
from ftpipe_runtime.spec.weights import WRAPPER_PREFIX
from torch import fx

from ..model.tasks import Task
from ..model.zoo import ModelSpec
from .opgraph import Edge, ModelInput, Node, OpGraph, Param

# Tracing artefacts with no effect on the computation.
_DROP = {
    "aten._assert_tensor_metadata.default",
    "aten._assert_scalar.default",
    "aten.sym_constrain_range_for_size.default",
}
# Ops that only re-describe memory: no flops, no bytes, no saved activations.
VIEW_OPS = {
    "aten.view.default",
    "aten.reshape.default",
    "aten.transpose.int",
    "aten.unsqueeze.default",
    "aten.squeeze.dim",
    "aten.squeeze.default",
    "aten.expand.default",
    "aten.permute.default",
    "aten.t.default",
    "aten.slice.Tensor",
    "aten.select.int",
    "aten.alias.default",
    "aten.detach.default",
    "aten.unflatten.int",
    "aten.flatten.using_ints",
    "aten.split.Tensor",
    "aten.chunk.default",
    "aten.unbind.int",
    "aten.lift_fresh_copy.default",
    "_operator.getitem",
}


def _canonical_params(model: torch.nn.Module) -> tuple[dict[str, str], dict[str, torch.Tensor]]:
    """alias -> canonical name (first name of each tensor), canonical -> tensor."""
    first: dict[int, str] = {}
    alias: dict[str, str] = {}
    tensors: dict[str, torch.Tensor] = {}
    named = list(model.named_parameters(remove_duplicate=False))
    named += list(model.named_buffers(remove_duplicate=False))
    for name, t in named:
        name = name.removeprefix(WRAPPER_PREFIX)
        key = id(t)
        if key not in first:
            first[key] = name
            tensors[name] = t
        alias[name] = first[key]
    return alias, tensors


def to_graph(spec: ModelSpec, task: Task, micro_batch: int, model, inputs, program):
    """The OpGraph of an exported training forward (op granularity), and the placeholders."""
    alias, tensors = _canonical_params(model)
    placeholders = _placeholders(program, alias, tensors, list(inputs))
    out_node = next(n for n in program.graph.nodes if n.op == "output")
    loss = out_node.args[0][0]
    nodes, edges, used = _nodes_and_edges(program.graph, loss, placeholders, tensors)
    stored = spec.checkpoint_aliases(model)  # the folder's own names for the parameters
    converted = {n: list(keys) for n, keys in stored.items() if isinstance(keys, tuple)}
    g = OpGraph(
        model=spec.spec,
        nodes=tuple(nodes),
        edges=tuple(edges),
        params=tuple(_params(alias, tensors, used, stored)),
        inputs=tuple(
            ModelInput(k, tuple(v.shape), str(v.dtype).removeprefix("torch."))
            for k, v in inputs.items()
        ),
        output=loss.name,
        # Keys the checkpoint holds a parameter as, that transformers converts into it
        # (MoE experts one by one): the folder's check reads them, the stages convert them.
        meta={**_meta(spec, task, micro_batch), **({"converted": converted} if converted else {})},
    )
    g.validate()
    return g, placeholders


def _placeholders(program, alias, tensors, input_names) -> dict[str, tuple[str, str]]:
    """Placeholder name -> ("param", canonical name) | ("input", input name); constant
    tensors join the parameters (in `alias` and `tensors`)."""
    placeholders: dict[str, tuple[str, str]] = {}
    user_inputs = iter(input_names)
    for s in program.graph_signature.input_specs:
        kind = s.kind.name
        if kind in ("PARAMETER", "BUFFER", "CONSTANT_TENSOR"):
            target = s.target.removeprefix(WRAPPER_PREFIX)
            if kind == "CONSTANT_TENSOR":
                tensors[target] = program.constants[s.target]
                alias[target] = target
            placeholders[s.arg.name] = ("param", alias[target])
        elif kind == "USER_INPUT":
            placeholders[s.arg.name] = ("input", next(user_inputs))
    return placeholders


def _nodes_and_edges(graph: fx.Graph, loss: fx.Node, placeholders, tensors):
    """One Node per live ATen call, the edges between them, and the parameters read."""
    live = _live_nodes(graph, loss)
    params_used: dict[str, None] = {}
    nodes: list[Node] = []
    edges: list[Edge] = []
    grad: dict[str, bool] = {}
    out_bytes: dict[str, int] = {}
    for n in graph.nodes:
        if n.op != "call_function" or n not in live:
            continue
        op = op_name(n.target)
        preds, params, ins = [], [], []
        for a in _node_args(n):
            if a.op == "placeholder":
                kind, name = placeholders[a.name]
                (params if kind == "param" else ins).append(name)
            elif a.op == "call_function":
                preds.append(a.name)
        shape, dtype, nbytes = describe_value(n.meta.get("val"))
        float_out = dtype.startswith("float") or dtype.startswith("bfloat")
        needs = (
            float_out
            and op != "aten.detach.default"
            and (any(tensors[p].requires_grad for p in params) or any(grad[p] for p in preds))
        )
        grad[n.name] = needs
        out_bytes[n.name] = nbytes
        scope, mtype = _scope(n)
        nodes.append(
            Node(
                id=n.name,
                op=op,
                scope=scope,
                module_type=mtype,
                shape=shape,
                dtype=dtype,
                out_bytes=nbytes,
                params=tuple(dict.fromkeys(params)),
                inputs=tuple(dict.fromkeys(ins)),
                requires_grad=needs,
                members=(n.name,),
            )
        )
        params_used.update(dict.fromkeys(params))
        for p in dict.fromkeys(preds):
            b = nbytes if op == "_operator.getitem" else out_bytes[p]
            edges.append(Edge(p, n.name, b))
    return nodes, edges, list(params_used)


def _params(alias, tensors, used: list[str], stored: dict) -> list[Param]:
    """The parameters the graph reads, in first-use order, with every name they go by
    (`stored`: the checkpoint's names, `ModelSpec.checkpoint_aliases`)."""
    by_canon: dict[str, list[str]] = {}
    for a, c in alias.items():
        by_canon.setdefault(c, []).append(a)
    for name, key in stored.items():
        if isinstance(key, str):  # a tuple: keys converted into it, not another name
            by_canon.setdefault(alias.get(name, name), []).append(key)
    params = []
    for name in used:
        t = tensors[name]
        params.append(
            Param(
                name=name,
                shape=tuple(t.shape),
                dtype=str(t.dtype).removeprefix("torch."),
                bytes=t.numel() * t.element_size(),
                aliases=tuple(a for a in by_canon[name] if a != name),
                trainable=isinstance(t, torch.nn.Parameter) and t.requires_grad,
                frozen=isinstance(t, torch.nn.Parameter) and not t.requires_grad,
            )
        )
    return params


def _meta(spec: ModelSpec, task: Task, micro_batch: int) -> dict:
    """What later steps (codegen, the runtime's synthetic data) need to know of the model."""
    return {
        "task": task.name,
        "head": spec.head,
        "model_type": spec.model_type,
        "seq_len": task.seq_len,
        "target_len": task.target_len,
        "micro_batch": micro_batch,
        "batch": task.batch,
        "optimizer": task.optimizer,
        "lr": task.lr,
        "vocab": spec.vocab.to_json(),
        "hf_class": spec.hf_class,
        "config": spec.config,
        "model_kind": spec.kind,
        "model_name": spec.name,
        **({"freeze": spec.freeze} if spec.freeze else {}),
        **({"lora": spec.lora} if spec.lora else {}),
    }


def _live_nodes(graph: fx.Graph, loss: fx.Node) -> set:
    """Nodes the loss depends on: drops asserts, guards and other dead artefacts."""
    live, stack = set(), [loss]
    while stack:
        n = stack.pop()
        if n in live:
            continue
        live.add(n)
        stack.extend(a for a in _node_args(n) if a not in live)
    return {n for n in live if n.op != "call_function" or op_name(n.target) not in _DROP}


def _node_args(n: fx.Node) -> list[fx.Node]:
    found: list[fx.Node] = []
    fx.node.map_arg((n.args, n.kwargs), found.append)
    return found


def op_name(target) -> str:
    if isinstance(target, torch._ops.OpOverload):
        return (
            f"aten.{target._schema.name.split('::')[1]}.{target._overloadname}"
            if target.namespace == "aten"
            else str(target)
        )
    return f"{getattr(target, '__module__', '')}.{getattr(target, '__name__', str(target))}".lstrip(
        "."
    )


def _scope(n: fx.Node) -> tuple[str, str]:
    stack = n.meta.get("nn_module_stack") or {}
    if not stack:
        return "", ""
    path, mtype = list(stack.values())[-1]
    mtype = mtype if isinstance(mtype, str) else getattr(mtype, "__name__", str(mtype))
    return scope_of(path), mtype.rsplit(".", 1)[-1]


def scope_of(path: str) -> str:
    """'m.encoder.block.3' -> 'encoder.block.3' (the wrapper module's prefix removed)."""
    if path == WRAPPER_PREFIX.rstrip("."):
        return ""
    return path.removeprefix(WRAPPER_PREFIX)


def describe_value(val) -> tuple[tuple[int, ...], str, int]:
    """(first output's shape, its dtype, bytes of all outputs) from a node's fake value."""
    if isinstance(val, torch.Tensor):
        return (
            tuple(int(s) for s in val.shape),
            str(val.dtype).removeprefix("torch."),
            val.numel() * val.element_size(),
        )
    if isinstance(val, (tuple, list)):
        parts = [describe_value(v) for v in val if v is not None]
        if not parts:
            return (), "none", 0
        return parts[0][0], parts[0][1], sum(p[2] for p in parts)
    return (), type(val).__name__, 0


def map_tensors(v, fn):
    """`fn` of every tensor in a value (a tensor, or tuples and lists of them), the structure
    kept (built from a list: what torch's structseqs accept too)."""
    if isinstance(v, torch.Tensor):
        return fn(v)
    if isinstance(v, (tuple, list)):
        return type(v)([map_tensors(x, fn) for x in v])
    return v


def tensors_in(v) -> list:
    """The tensors of a value (a tensor, or tuples and lists of them), in order."""
    if isinstance(v, torch.Tensor):
        return [v]
    if isinstance(v, (tuple, list)):
        return [t for x in v for t in tensors_in(x)]
    return []


def retarget(args, kwargs, device):
    """Replace every device baked into an op's arguments at trace time with `device`."""
    fix = lambda v: device if isinstance(v, torch.device) else v  # noqa: E731
    return tuple(fix(a) for a in args), {k: fix(v) for k, v in kwargs.items()}
