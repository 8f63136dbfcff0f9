"""Tracing: `torch.export` (non-strict) of the training forward, loss included, into an OpGraph.

traced = trace_model(spec, task, micro_batch=4)   # on `meta`: a 3B model costs no memory
traced.graph      # OpGraph at op granularity
traced.program    # the ExportedProgram (kept in memory for costs and code generation)
"""

from __future__ import annotations

import contextlib
import io
import logging
import sys
import textwrap
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from ftpipe_runtime.job.signals import noting
from ftpipe_runtime.train.precision import get_precision
from torch import fx
from torch.overrides import TorchFunctionMode

from ..errors import TraceError
from ..model.folder import check_weights, read_headers
from ..model.tasks import Task
from ..model.zoo import ModelSpec
from .exported import describe_value, to_graph
from .fuse import fuse_linear_cross_entropy
from .opgraph import OpGraph
from .packing import check_documents_apart
from .repeat import export_repeated


@dataclass
class Traced:
    graph: OpGraph
    program: torch.export.ExportedProgram
    # placeholder name -> ("param", canonical name) | ("input", input name)
    placeholders: dict[str, tuple[str, str]]


def trace_model(
    spec: ModelSpec,
    task: Task,
    micro_batch: int,
    device="meta",
    model=None,
    precision="fp32",
    fuse_loss: bool = True,
) -> Traced:
    """Trace the training forward of `spec` as it runs in `precision` (the model built at its
    compute dtype, as transformers builds it: the casts and fp32 islands are the model's);
    `fuse_loss`: an LM head and its cross-entropy as one op (`fuse`)."""
    compute = get_precision(precision).dtype
    if model is None:
        model = spec.build(device, dtype=None if compute == torch.float32 else compute)
    inputs = spec.example_inputs(task, micro_batch, device)
    with noting() as stops, _held_output() as said, _ConstantsOnCpu(), _HistcAnywhere(), \
            code_on_demand():  # fmt: skip
        try:
            program = _exported(spec, model, tuple(inputs.values()))
        except TraceError:  # ours (a region that cannot be inlined): already one sentence
            raise
        except Exception as e:  # the exporter raises many types; all mean the same to a user
            if stops:  # a Ctrl-C or SIGTERM the exporter wrapped into an error of its own
                raise type(stops[0])() from None
            _printed_with_sources(model, tuple(inputs.values()), said)
            raise _trace_error(spec, e, said.getvalue()) from None
    if stops:  # one the exporter swallowed (or the cut export's fallback to a whole one)
        raise type(stops[0])()
    sys.stderr.write(said.getvalue())  # a successful export's warnings, as it said them
    _check_loss(spec, program)
    if spec.packed:  # the attention must mask by the documents the positions tell apart
        check_documents_apart(spec, program)
    if fuse_loss:
        fuse_linear_cross_entropy(program.graph_module)  # the LM head and its loss: one op
    graph, placeholders = to_graph(spec, task, micro_batch, model, inputs, program)
    if spec.path:  # the folder's weights are those of the traced parameters, or one sentence
        check_weights(spec.spec, read_headers(Path(spec.path)), graph.params,
                      graph.meta.get("converted"))  # fmt: skip
    meta = {**graph.meta, "precision": precision, "compute_dtype": str(compute)[6:]}
    return Traced(replace(graph, meta=meta), program, placeholders)


def _exported(spec: ModelSpec, model, args: tuple) -> torch.export.ExportedProgram:
    """The program of the model's training forward, its regions inlined. A transformers
    model's stacks of alike layers are exported cut short and copied out (`repeat`: the
    same program, in a fraction of the time); a model function is exported whole (its
    loops may do anything)."""
    if spec.kind == "function":
        program = _export(model, args)
        inline_regions(program.graph_module)
        return program
    return export_repeated(model, args, _export, inline_regions)


def _export(model, args: tuple, sources: bool = False) -> torch.export.ExportedProgram:
    """torch.export (non-strict), without the source line of every op unless `sources`
    (unused by a successful trace, a fifth of the export's time)."""
    with _config(torch.fx.config, do_not_emit_stack_traces=not sources):
        return torch.export.export(model, args, strict=False)


def _printed_with_sources(model, args: tuple, said: io.StringIO) -> None:
    """After a failed export: what it prints with each op's source line (the partial graph
    `--debug` shows), from exporting again (the failure's only cost)."""
    said.seek(0)
    said.truncate()
    with contextlib.suppress(Exception):
        _export(model, args, sources=True)


@contextlib.contextmanager
def code_on_demand():
    """GraphModules made meanwhile generate their Python code when first run or read, not as
    they are made: a trace reads its graphs and runs none. Generating the code of T5-3B's
    whole graph took 0.2-0.3 s each time (the cut export's, the copied-out one's, the fused
    one's: 1.0 s of the compile in all). Where this torch has no lazy GraphModule, as ever."""
    lazy = getattr(fx, "_lazy_graph_module", None)
    made = getattr(torch.export.exported_program, "_create_graph_module_for_export", None)
    if lazy is None or made is None:
        yield
        return

    def on_demand(root, graph):  # what the ExportedProgram makes its module with
        return lazy._LazyGraphModule(root, graph)

    with lazy._use_lazy_graph_module(True):  # make_fx's modules
        torch.export.exported_program._create_graph_module_for_export = on_demand
        try:
            yield
        finally:
            torch.export.exported_program._create_graph_module_for_export = made


@contextlib.contextmanager
def _config(module, **values):
    """Set these settings meanwhile; one this torch does not have is left alone (torch.fx's
    `do_not_emit_stack_traces` is newer than 2.11: there the export just takes longer)."""
    values = {k: v for k, v in values.items() if hasattr(module, k)}
    saved = {k: getattr(module, k) for k in values}
    for k, v in values.items():
        setattr(module, k, v)
    try:
        yield
    finally:
        for k, v in saved.items():
            setattr(module, k, v)


class _ConstantsOnCpu(TorchFunctionMode):
    """Tensors the forward makes from Python data (Falcon's `qkv[..., [-2], :]`, a
    `torch.tensor(x, device=h.device)`) become constants of the program; made on `meta` they
    would lose their values, so they are made on the CPU (indices index a tensor on any
    device; other data is moved as the model asked, an op of the graph), and the generated
    stages hold them with their values."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in (torch.Tensor.__getitem__, torch.Tensor.__setitem__) and len(args) >= 2:
            args = (args[0], _index_on_cpu(args[1]), *args[2:])
        elif func in (torch.tensor, torch.as_tensor) and _is_meta(kwargs.get("device")):
            device = kwargs.pop("device")
            return func(*args, **kwargs).to(device)
        return func(*args, **kwargs)


class _HistcAnywhere(TorchFunctionMode):
    """`torch.histc` of integers counted on their float values and cast back: the same counts
    on every device. Models choose its input's dtype by device (transformers' grouped MoE
    experts: integers on a GPU, floats where the CPU kernel lacks integers), and a trace on
    `meta` takes the GPU's branch, which a CPU run of the package cannot execute."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.histc and args and not args[0].dtype.is_floating_point:
            x = args[0]
            return torch.histc(x.float(), *args[1:], **kwargs).to(x.dtype)
        return func(*args, **kwargs)


def _is_meta(device) -> bool:
    return device is not None and torch.device(device).type == "meta"


def _index_on_cpu(index):
    """An index with its lists of ints or bools as CPU tensors (what torch would make of
    them, but on the indexed tensor's device)."""
    if isinstance(index, tuple):
        return tuple(_index_on_cpu(i) for i in index)
    if isinstance(index, list) and index and _plain(index):
        return torch.tensor(index)
    return index


def _plain(data) -> bool:
    """Ints or bools only, possibly nested: data, not a list of tensors or slices."""
    if isinstance(data, list):
        return all(_plain(d) for d in data)
    return isinstance(data, (int, bool))


@contextlib.contextmanager
def _held_output():
    """What the exporter writes to stderr (prints, and torch's own log handlers) goes to a
    buffer instead: a failed export prints hundreds of lines of partial graph first."""
    said = io.StringIO()
    handlers = [
        h
        for name, logger in list(logging.Logger.manager.loggerDict.items())
        if name.split(".")[0] == "torch" and isinstance(logger, logging.Logger)
        for h in logger.handlers
        if isinstance(h, logging.StreamHandler) and h.stream in (sys.stderr, sys.__stderr__)
    ]
    streams = [h.setStream(said) for h in handlers]
    try:
        with contextlib.redirect_stderr(said):
            yield said
    finally:
        for h, stream in zip(handlers, streams):
            h.setStream(stream)


def _trace_error(spec: ModelSpec, e: Exception, printed: str) -> TraceError:
    """One sentence for a failed export. What the exporter printed (hundreds of lines of
    partial graph) is kept on the error as its `detail`, which `ftpipe --debug` shows."""
    reason = textwrap.shorten(f"{type(e).__name__}: {e}", 600)
    if spec.kind == "function" and _raised_by_user_code(e):
        error = TraceError(f"your model's forward raised {reason}")
    else:
        error = TraceError(
            f"torch.export could not trace {spec.spec}: {reason} -- try --granularity layer, "
            "or give a package.module:function spec whose model returns the loss from plain "
            "tensors"
        )
    error.detail = printed
    return error


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
