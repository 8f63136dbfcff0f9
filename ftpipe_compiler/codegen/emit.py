"""Turn a stage's traced values into the straight-line body of its `forward`.

One line per ATen call, `aten.<op>.<overload>(...)` exactly as traced, with four rewrites:
devices baked in by tracing become the stage's `device`, dropout's `train` flag becomes
`self.training`, a 16-bit trace's compute dtype becomes the stage's `self.compute_dtype`, and
an in-place op on a tensor the stage received works on a copy (the sender's tensor is not
the stage's to change). A weight owned by another stage is read from
`tensors` like an activation; its owner returns it (the parameter itself) beside its outputs.
"""

from __future__ import annotations

import keyword
import math
import operator

import torch
from torch import fx

from ..errors import FtpipeError
from ..graph.granularity import layer_key
from .names import Namer, module_stack, value_base, weight_base
from .source import literal, text
from .wiring import StageWiring, Wiring

MAX_LINE = 100
_OPERATORS = {getattr(operator, k): k for k in ("add", "sub", "mul", "truediv", "floordiv", "neg")}


def value_names(fx_graph: fx.Graph, placeholders: dict, model_inputs, weights=()) -> dict[str, str]:
    """One readable, unique identifier per traced value, the same in every stage, and per
    weight some stage receives (keyed by the parameter's name)."""
    namer = Namer(taken=model_inputs)
    names: dict[str, str] = {}
    calls = [n for n in fx_graph.nodes if n.op == "call_function"]
    bases = {n.name: value_base(n) for n in calls}
    for n in calls:  # values outside modules keep their traced names: the plan's names
        if not bases[n.name] and n.target is not operator.getitem:
            names[n.name] = namer.fresh(n.name)
    for n in fx_graph.nodes:
        if n.op == "placeholder":
            kind, name = placeholders.get(n.name, ("input", n.name))
            if kind == "input":
                names[n.name] = name
        elif n.op == "call_function" and n.name not in names:
            if n.target is operator.getitem and n.args[0].name in names:
                names[n.name] = namer.fresh(f"{names[n.args[0].name]}_{n.args[1]}")
            else:
                names[n.name] = namer.fresh(bases[n.name] or n.name)
    for w in weights:
        names[w] = namer.fresh(weight_base(w))
    return names


class StageEmitter:
    """Writes the body of one stage's forward."""

    def __init__(
        self,
        st: StageWiring,
        wiring: Wiring,
        names: dict[str, str],
        placeholders: dict,
        param_expr,
        compute: torch.dtype = torch.float32,
    ):
        self.st, self.wiring, self.names = st, wiring, dict(names)
        self.placeholders = placeholders
        self.param_expr = param_expr
        # Traced in 16 bits, a cast to that dtype is a cast to the compute dtype: it follows
        # the stage's (an fp32 run of the same code then computes what fp32 HF does).
        self.compute = compute if compute != torch.float32 else None
        self.uses_operator = False
        self.uses_device = False
        self.op_modules: set[str] = set()  # where the custom ops the body calls are defined

    def body(self) -> list[str]:
        lines = [f"{name} = tensors[{literal(name)}]" for name in self.st.model_inputs]
        for w in self.st.inputs:
            src = self.wiring.wires[w]
            note = f"  # {tuple(src.shape)} {src.dtype} from stage {src.producer}"
            lines.append(f"{self.names[w]} = tensors[{literal(w)}]{note}")
        code = self._nodes()
        if self.uses_device:
            first = self.st.model_inputs[:1] or [self.names[w] for w in self.st.inputs[:1]]
            lines.append(f"device = {first[0]}.device" if first else "device = self.device")
        lines += code
        return lines + self._return()

    def _nodes(self) -> list[str]:
        lines: list[str] = []
        block = sub = None
        for n in self.st.nodes:
            stack = module_stack(n)
            scope = stack[-1][0] if stack else ""
            types = dict(stack)
            b = layer_key(scope)
            if b != block:
                block, sub = b, None
                mtype = types.get(b) or (stack[0][1] if stack and not b else "")
                lines.append(text(f"# {b or 'top level'}" + (f" ({mtype})" if mtype else "")))
            inner = [s for s, _ in stack if s.startswith(b + ".") and s != b] if b else []
            if inner and inner[0] != sub:
                sub = inner[0]
                lines.append(text(f"# - {sub[len(b) + 1 :]} ({types[sub]})"))
            lines.append(self._statement(n))
        return lines

    def _statement(self, n: fx.Node) -> str:
        name = self.names[n.name]
        target = n.target
        if target is operator.getitem:
            return f"{name} = {self._arg(n.args[0])}[{n.args[1]!r}]"
        args = list(n.args)
        kwargs = dict(n.kwargs)
        if isinstance(target, torch._ops.OpOverload):
            _follow_training_mode(target, args, kwargs)
            if kwargs.get("pin_memory") is False:
                del kwargs["pin_memory"]  # the default: noise from tracing
            mutated = _mutated_arg(target)
            parts = [self._arg(a) for a in args] + [
                f"{k}={self._arg(v)}" for k, v in kwargs.items()
            ]
            if mutated is not None and mutated < len(args) and self._is_received(args[mutated]):
                parts[mutated] += ".clone()"
                self.names[args[mutated].name] = name  # later reads see the changed copy
            module = op_module(target)
            if module is not None:
                self.op_modules.add(module)
            return _wrap(f"{name} = ", _op_path(target), parts)
        if target in _OPERATORS:
            self.uses_operator = True
            return _wrap(
                f"{name} = ", f"operator.{_OPERATORS[target]}", [self._arg(a) for a in args]
            )
        raise FtpipeError(
            f"cannot generate code for {n.name} ({target}): only ATen operators are supported; "
            "try --granularity layer or a model without this construct"
        )

    def _is_received(self, a) -> bool:
        if not isinstance(a, fx.Node):
            return False
        if a.op == "placeholder":
            kind, name = self.placeholders.get(a.name, ("input", a.name))
            return kind == "input" or name in self.st.inputs
        return a.name in self.st.inputs

    def _arg(self, a) -> str:
        if isinstance(a, fx.Node):
            if a.op == "placeholder":
                kind, name = self.placeholders[a.name]
                if kind == "param" and name in self.st.inputs:  # another stage's weight:
                    return self.names.get(a.name, self.names[name])  # received (or cloned here)
                return self.param_expr(name) if kind == "param" else self.names[a.name]
            return self.names[a.name]
        if isinstance(a, torch.device):
            self.uses_device = True  # tracing ran on `meta`: run where the stage lives
            return "device"
        if isinstance(a, _Raw):
            return a.text
        if isinstance(a, torch.dtype) and a == self.compute:
            return "self.compute_dtype"
        if isinstance(a, list):
            return "[" + ", ".join(self._arg(x) for x in a) + "]"
        if isinstance(a, tuple):
            inner = ", ".join(self._arg(x) for x in a)
            return f"({inner},)" if len(a) == 1 else f"({inner})"
        return constant(a)

    def _return(self) -> list[str]:
        loss = self.names[self.wiring.loss.name] if self.st.is_loss else None
        items = [f"{literal('loss')}: {loss}"] if loss else []
        for w in self.st.outputs:
            if self.wiring.wires[w].weight:  # the parameter itself: its gradient accumulates in it
                items.append(f"{literal(w)}: {self.param_expr(w)}")
            else:  # gloo sends only contiguous tensors (stride-0 masks, permuted biases)
                items.append(f"{literal(w)}: {self.names[w]}.contiguous()")
        line = "return {" + ", ".join(items) + "}"
        if len(line) + 8 <= MAX_LINE:
            return [line]
        return ["return {", *(f"    {i}," for i in items), "}"]


class _Raw:
    """Source text placed as is (`self.training`)."""

    def __init__(self, text: str):
        self.text = text


def constant(a) -> str:
    """A traced constant as Python source."""
    if isinstance(a, torch.dtype):
        return str(a)
    if isinstance(a, (torch.layout, torch.memory_format)):
        return str(a)
    if isinstance(a, float):
        if math.isnan(a):
            return 'float("nan")'
        if math.isinf(a):
            return 'float("inf")' if a > 0 else '-float("inf")'
        return repr(a)
    if isinstance(a, str):
        return literal(a)
    if a is None or isinstance(a, (bool, int, slice)) or a is Ellipsis:
        return repr(a)
    raise FtpipeError(f"cannot write the traced constant {a!r} ({type(a).__name__}) as code")


_BUILT_IN = ("aten", "prims", "ftpipe")  # namespaces torch, or the runtime, registers


def op_module(target: torch._ops.OpOverload) -> str | None:
    """The module that defines a custom op (`torch.library.custom_op`), which the package must
    import before calling it (transformers' `torch.ops.transformers.grouped_mm_fallback`, in
    `transformers.integrations.moe`): None for torch's own ops, or where torch does not say."""
    ns = target._schema.name.split("::")[0]
    if ns in _BUILT_IN:
        return None
    try:
        from torch._library.custom_ops import OPDEFS
    except ImportError:  # another torch: the op must be registered by what the run imports
        return None
    made = OPDEFS.get(target._schema.name)
    module = getattr(getattr(made, "_init_fn", None), "__module__", None)
    return module if isinstance(module, str) and module != "__main__" else None


def _op_path(target: torch._ops.OpOverload) -> str:
    ns, packet = target._schema.name.split("::")
    overload = target._overloadname
    base = "aten" if ns == "aten" else f"torch.ops.{ns}"
    if keyword.iskeyword(packet) or keyword.iskeyword(overload):
        return f"getattr(getattr({base}, {literal(packet)}), {literal(overload)})"
    return f"{base}.{packet}.{overload}"


def _follow_training_mode(target: torch._ops.OpOverload, args: list, kwargs: dict) -> None:
    """Tracing ran in training mode and baked it in: dropout's `train`, batch norm's
    `training`, attention's `dropout_p`. Make them follow the stage's own mode instead."""
    for i, arg in enumerate(target._schema.arguments):
        if i < len(args):
            where, key = args, i
        elif arg.name in kwargs:
            where, key = kwargs, arg.name
        else:
            continue
        value = where[key]
        if arg.name in ("train", "training") and value is True:
            where[key] = _Raw("self.training")
        elif arg.name == "dropout_p" and isinstance(value, float) and value > 0:
            where[key] = _Raw(f"{value!r} if self.training else 0.0")


def _mutated_arg(target: torch._ops.OpOverload) -> int | None:
    """Index of the argument an in-place op writes to (add_, copy_...), or None."""
    for i, arg in enumerate(target._schema.arguments):
        if arg.alias_info is not None and arg.alias_info.is_write:
            return i
    return None


def _wrap(head: str, fn: str, parts: list[str]) -> str:
    """`x = f(a, b)` on one line; else the arguments on the next line; else one per line."""
    args = ", ".join(parts)
    if len(head) + len(fn) + len(args) + 2 + 8 <= MAX_LINE:
        return f"{head}{fn}({args})"
    if len(args) + 12 <= MAX_LINE:
        return f"{head}{fn}(\n    {args}\n)"
    return f"{head}{fn}(\n" + "".join(f"    {p},\n" for p in parts) + ")"
