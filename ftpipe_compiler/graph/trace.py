"""Tracing: `torch.export` (non-strict) of the training forward, loss included, into an OpGraph.

traced = trace_model(spec, task, micro_batch=4)   # on `meta`: a 3B model costs no memory
traced.graph      # OpGraph at op granularity
traced.program    # the ExportedProgram (kept in memory for costs and code generation)
"""

from __future__ import annotations

import contextlib
import signal
import textwrap
import threading
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from ftpipe_runtime.precision import get_precision
from torch import fx

from ..errors import TraceError
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
WRAPPER_PREFIX = "m."


@dataclass
class Traced:
    graph: OpGraph
    program: torch.export.ExportedProgram
    # placeholder name -> ("param", canonical name) | ("input", input name)
    placeholders: dict[str, tuple[str, str]]


def trace_model(
    spec: ModelSpec, task: Task, micro_batch: int, device="meta", model=None, precision="fp32"
) -> Traced:
    """Trace the training forward of `spec` as it runs in `precision` (the model built at its
    compute dtype, as transformers builds it: the casts and fp32 islands are the model's)."""
    compute = get_precision(precision).dtype
    if model is None:
        model = spec.build(device, dtype=None if compute == torch.float32 else compute)
    inputs = spec.example_inputs(task, micro_batch, device)
    with _noting_ctrl_c() as interrupted:
        try:
            program = torch.export.export(model, tuple(inputs.values()), strict=False)
        except Exception as e:  # the exporter raises many types; all mean the same to a user
            if interrupted:  # a Ctrl-C the exporter wrapped into an error of its own
                raise KeyboardInterrupt from None
            reason = textwrap.shorten(f"{type(e).__name__}: {e}", 600)
            if spec.kind == "function" and _raised_by_user_code(e):
                raise TraceError(f"your model's forward raised {reason}") from None
            raise TraceError(
                f"torch.export could not trace {spec.spec}: {reason} -- try --granularity layer, "
                "or give a package.module:function spec whose model returns the loss from plain "
                "tensors"
            ) from None
    _check_loss(spec, program)
    inline_regions(program.graph_module)
    graph, program, placeholders = _to_graph(spec, task, micro_batch, model, inputs, program)
    meta = {**graph.meta, "precision": precision, "compute_dtype": str(compute)[6:]}
    return Traced(replace(graph, meta=meta), program, placeholders)


def inline_regions(gm: fx.GraphModule) -> None:
    """Splice in the sub-graphs torch.export wraps `torch.no_grad()` code in (the rotary
    embeddings of Llama, Mistral, Qwen...), so that every stage is plain ATen code. Their
    outputs are detached: no gradient flows back through them, as under no_grad."""
    graph = gm.graph
    for hop in [n for n in graph.nodes if n.op == "call_function" and n.target in _REGIONS]:
        grad_on, sub_attr, *args = _REGIONS[hop.target](hop.args)
        sub = getattr(gm, sub_attr.target)
        env = dict(zip([n for n in sub.graph.nodes if n.op == "placeholder"], args))
        with graph.inserting_before(hop):
            for n in sub.graph.nodes:
                if n.op == "output":
                    outs = [env[o] for o in n.args[0]]
                elif n.op == "call_function" and n.target not in _REGIONS:
                    env[n] = graph.node_copy(n, env.__getitem__)
                elif n.op != "placeholder":
                    raise TraceError(f"cannot inline {n.target} nested in {hop.target}")
        for user in list(hop.users):  # getitem(hop, i)
            out = outs[user.args[1]]
            if not grad_on:
                with graph.inserting_before(hop):
                    out = _detached(graph, out, f"{user.name}_no_grad")
            user.replace_all_uses_with(out)
            graph.erase_node(user)
        graph.erase_node(hop)
        if not sub_attr.users:
            graph.erase_node(sub_attr)
            delattr(gm, sub_attr.target)
    gm.recompile()


def _detached(graph: fx.Graph, value: fx.Node, name: str) -> fx.Node:
    node = graph.create_node("call_function", torch.ops.aten.detach.default, (value,), name=name)
    node.meta = {k: v for k, v in value.meta.items() if k in ("val", "nn_module_stack")}
    return node


def _autocast_off(args):
    device, dtype, enabled, cache, sub, *rest = args
    if enabled:  # inlining would drop the cast: nothing traced on meta or the CPU has one
        raise TraceError("cannot inline an autocast region; trace without autocast")
    return (True, sub, *rest)


# torch.export's wrapper ops -> (gradients on?, the sub-graph's attribute node, its inputs)
_REGIONS = {
    torch.ops.higher_order.wrap_with_set_grad_enabled: lambda args: args,
    torch.ops.higher_order.wrap_with_autocast: _autocast_off,
}


@contextlib.contextmanager
def _noting_ctrl_c():
    """A list that becomes non-empty when SIGINT arrives; the interrupt is still raised."""
    seen: list[bool] = []
    if threading.current_thread() is not threading.main_thread():
        yield seen
        return
    previous = signal.getsignal(signal.SIGINT)

    def note(signum, frame):
        seen.append(True)
        raise KeyboardInterrupt

    signal.signal(signal.SIGINT, note)
    try:
        yield seen
    finally:
        signal.signal(signal.SIGINT, previous)


def _raised_by_user_code(e: BaseException) -> bool:
    """True when the innermost frame of the traceback is outside torch and transformers."""
    tb = e.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    if tb is None:
        return False
    where = Path(tb.tb_frame.f_code.co_filename).resolve()
    libraries = [Path(torch.__file__).resolve().parent]
    with contextlib.suppress(ImportError):
        import transformers

        libraries.append(Path(transformers.__file__).resolve().parent)
    return not any(where.is_relative_to(lib) for lib in libraries)


def _check_loss(spec: ModelSpec, program) -> None:
    """The model's forward must return the loss: one floating-point number per micro-batch."""
    out = next(n for n in program.graph.nodes if n.op == "output").args[0]
    val = out[0].meta.get("val") if out and isinstance(out[0], fx.Node) else None
    if not (isinstance(val, torch.Tensor) and val.dim() == 0 and val.is_floating_point()):
        shape, dtype, _ = describe_value(val)
        got = f"a {dtype} of shape {shape}" if val is not None else "no tensor"
        raise TraceError(
            f"the forward of {spec.spec} returns {got}, not a scalar loss; make it return the "
            "loss (e.g. its .mean())"
        )


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


def _to_graph(spec, task, micro_batch, model, inputs, program):
    sig = program.graph_signature
    alias, tensors = _canonical_params(model)
    placeholders: dict[str, tuple[str, str]] = {}
    input_names = list(inputs)
    user_inputs = iter(input_names)
    for s in sig.input_specs:
        kind = s.kind.name
        if kind in ("PARAMETER", "BUFFER", "CONSTANT_TENSOR"):
            target = s.target.removeprefix(WRAPPER_PREFIX)
            if kind == "CONSTANT_TENSOR":
                tensors[target] = program.constants[s.target]
                alias[target] = target
            placeholders[s.arg.name] = ("param", alias[target])
        elif kind == "USER_INPUT":
            placeholders[s.arg.name] = ("input", next(user_inputs))
    graph = program.graph
    out_node = next(n for n in graph.nodes if n.op == "output")
    loss = out_node.args[0][0]
    live = _live_nodes(graph, loss)

    params_used: dict[str, set] = {}
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
        for p in params:
            params_used.setdefault(p, set())
        for p in dict.fromkeys(preds):
            b = nbytes if op == "_operator.getitem" else out_bytes[p]
            edges.append(Edge(p, n.name, b))
    params = []
    by_canon: dict[str, list[str]] = {}
    for a, c in alias.items():
        by_canon.setdefault(c, []).append(a)
    for name, stored in spec.checkpoint_aliases(model).items():  # the folder's own names
        by_canon.setdefault(alias.get(name, name), []).append(stored)
    for name in params_used:
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
    g = OpGraph(
        model=spec.spec,
        nodes=tuple(nodes),
        edges=tuple(edges),
        params=tuple(params),
        inputs=tuple(
            ModelInput(k, tuple(v.shape), str(v.dtype).removeprefix("torch."))
            for k, v in inputs.items()
        ),
        output=loss.name,
        meta=_meta(spec, task, micro_batch),
    )
    g.validate()
    return g, program, placeholders


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
    path = (
        path.removeprefix("m").removeprefix(".")
        if path in ("m",) or path.startswith(WRAPPER_PREFIX)
        else path
    )
    return path, mtype.rsplit(".", 1)[-1]


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


def retarget(args, kwargs, device):
    """Replace every device baked into an op's arguments at trace time with `device`."""
    fix = lambda v: device if isinstance(v, torch.device) else v  # noqa: E731
    return tuple(fix(a) for a in args), {k: fix(v) for k, v in kwargs.items()}
