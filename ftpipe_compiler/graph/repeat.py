"""Exporting a model whose layers repeat: a few layers of each stack exported, the others copied.

    program = export_repeated(model, args, export, prepare)   # what export(model, args) makes

`torch.export` spends about 0.15 s per transformer block here (T5-3B: 48 of them, most of a
compile's trace). A stack of alike layers -- an `nn.ModuleList` whose layers after the first
have the same classes, parameter shapes and settings, only their own index differing
(`layer_idx`) -- traces to the same ops layer after layer. So each such stack is cut to its
first `KEEP` layers for the export, and the last kept layer's ops are copied for the others:
its parameters renamed to the copy's, what it read from the layer before read from the copy
before, everything else (masks, T5's position bias made by the first layer) read as it is.
Names, scopes and values come out as the whole export makes them (tests compare the two
node for node).

Copies are made only where the kept layers show they hold: the last kept layer must be the
one before it with exactly that renaming, every op from the one before the last on inside
those two layers, and node names counting up by the same step in each layer. The first
layer may differ: T5's computes the position bias, ops the others lack; its ops are paired
with the second layer's in order (`_paired`), the extra ones read as they are. So three
layers are exported per stack (a fourth, to compare two alike layers after the first, cost
T5-3B 0.3 s). Otherwise the model is exported whole.
"""

from __future__ import annotations

import contextlib
import difflib
import re
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import fx, nn
from torch.export.graph_signature import (
    ExportGraphSignature,
    InputKind,
    InputSpec,
    OutputSpec,
    TensorArgument,
)

__all__ = ["KEEP", "Stack", "export_repeated", "repeated_stacks"]

KEEP = 3  # layers exported per stack: the first may differ, the last two are compared
MIN_LAYERS = KEEP + 2  # fewer and the copying saves too little to be worth its checks
_PLAIN = (bool, int, float, str, type(None))
_PREFIX = {InputKind.PARAMETER: "p_", InputKind.BUFFER: "b_"}
try:  # a GraphModule that makes its code when first run, where the trace asks (trace.py)
    from torch.fx._lazy_graph_module import _make_graph_module
except ImportError:  # an older torch: the code is made at once
    _make_graph_module = fx.GraphModule


@dataclass(frozen=True)
class Stack:
    path: str  # the ModuleList's name in the model: "m.encoder.block"
    layers: int  # how many layers the model has there


def export_repeated(
    model: nn.Module,
    args: tuple,
    export: Callable[[nn.Module, tuple], torch.export.ExportedProgram],
    prepare: Callable[[fx.GraphModule], None] = lambda gm: None,
) -> torch.export.ExportedProgram:
    """`export(model, args)` then `prepare(program.graph_module)`, its stacks of alike layers
    exported cut to `KEEP` layers and copied out (the whole model exported when that cannot
    be shown to give the same program)."""
    stacks = repeated_stacks(model)
    if stacks:
        with _cut(model, stacks):
            try:
                program = export(model, args)
            except Exception:  # a model that needs all its layers: the whole export says why
                program = None
            names = _input_order(model) if program is not None else None
        if program is not None:
            prepare(program.graph_module)
            full = _Expansion(program, model, stacks, names).run()
            if full is not None:
                return full
    program = export(model, args)
    prepare(program.graph_module)
    return program


def repeated_stacks(model: nn.Module) -> list[Stack]:
    """The module lists of at least `MIN_LAYERS` whose layers after the first are alike and
    share no parameter (outermost ones only)."""
    found = []
    for path, module in model.named_modules():
        if not isinstance(module, nn.ModuleList) or len(module) < MIN_LAYERS:
            continue
        layers = list(module)[1:]
        own = set.intersection(*(_own_index(layer, i) for i, layer in enumerate(layers, 1)))
        if len({_signature(layer, i, own) for i, layer in enumerate(layers, 1)}) != 1:
            continue
        tensors = [id(t) for layer in module for t in (*layer.parameters(), *layer.buffers())]
        if len(tensors) == len(set(tensors)):
            found.append(Stack(path, len(module)))
    return [s for s in found if not any(s.path.startswith(o.path + ".") for o in found)]


def _settings(module: nn.Module, prefix: str = ""):
    """(dotted name, value) of a module's own attributes, its submodules' after."""
    for k, v in sorted(vars(module).items()):
        if not k.startswith("_"):
            yield prefix + k, v
    for k, c in module._modules.items():
        if c is not None:
            yield from _settings(c, f"{prefix}{k}.")


def _own_index(layer: nn.Module, index: int) -> set[str]:
    """The integer settings that equal the layer's index (`layer_idx`, or a coincidence)."""
    return {k for k, v in _settings(layer) if type(v) is int and v == index}


def _signature(module: nn.Module, index: int, own: set[str], prefix: str = ""):
    """What makes two layers alike: classes, parameter and buffer shapes, plain settings
    (those in `own`, every layer's own index, aside), recursively."""
    plain = []
    for k, v in sorted(vars(module).items()):
        if k.startswith("_"):
            continue
        if isinstance(v, _PLAIN) or (
            isinstance(v, tuple) and all(isinstance(x, _PLAIN) for x in v)
        ):
            plain.append((k, "<index>" if prefix + k in own else v))
        else:
            plain.append((k, type(v).__qualname__))
    params = tuple(
        (k, tuple(p.shape), p.dtype, p.requires_grad)
        for k, p in module._parameters.items()
        if p is not None
    )
    buffers = tuple(
        (k, tuple(b.shape), b.dtype, k in module._non_persistent_buffers_set)
        for k, b in module._buffers.items()
        if b is not None
    )
    children = tuple(
        (k, _signature(c, index, own, f"{prefix}{k}."))
        for k, c in module._modules.items()
        if c is not None
    )
    return type(module), tuple(plain), params, buffers, children


@contextlib.contextmanager
def _cut(model: nn.Module, stacks: list[Stack]):
    """The stacks hold their first KEEP layers meanwhile."""
    saved = []
    for s in stacks:
        stack = model.get_submodule(s.path)
        saved.append((stack, stack._modules))
        stack._modules = dict(list(stack._modules.items())[:KEEP])
    try:
        yield
    finally:
        for stack, modules in saved:
            stack._modules = modules


def _input_order(model: nn.Module) -> tuple[list[str], list[str]]:
    """Parameter and buffer names in the order torch.export lifts them."""
    params = [n for n, _ in model.named_parameters(remove_duplicate=False)]
    buffers = [n for n, _ in model.named_buffers(remove_duplicate=False)]
    return params, buffers


def placeholder_name(kind: InputKind, target: str) -> str:
    """The placeholder torch.export names a parameter or buffer by (its placeholder pass)."""
    return _PREFIX[kind] + re.sub(r"[^a-zA-Z0-9]", "_", target.lower())


_COUNTED = re.compile(r"(.*)_(\d+)$")


def _base(name: str) -> tuple[str, int]:
    """'linear_12' -> ('linear', 12); 'linear' -> ('linear', 0)."""
    m = _COUNTED.match(name)
    return (m.group(1), int(m.group(2))) if m else (name, 0)


def _named(base: str, count: int) -> str:
    return f"{base}_{count}" if count else base


class _Mismatch(Exception):
    """The kept layers do not show that copying gives the whole export."""


class _Expansion:
    """The cut program with each stack's missing layers copied in (see the module doc)."""

    def __init__(self, program, model: nn.Module, stacks: list[Stack], cut_order):
        self.program, self.model, self.stacks = program, model, stacks
        self.cut_order = cut_order
        self.graph = program.graph
        self.specs = {s.arg.name: s for s in program.graph_signature.input_specs}
        self.by_target = {s.target: s for s in program.graph_signature.input_specs if s.target}
        self.placeholder = {n.name: n for n in self.graph.nodes if n.op == "placeholder"}
        self.template_of: dict[str, str] = {}  # a copy's placeholder -> the kept layer's

    def run(self) -> torch.export.ExportedProgram | None:
        try:
            layouts = [self._layout(s) for s in self.stacks]
            return self._build(layouts)
        except _Mismatch:
            return None

    # --- what the kept layers show ---
    def _layer_of(self, n: fx.Node, path: str) -> int | None:
        for p, _ in (n.meta.get("nn_module_stack") or {}).values():
            if p.startswith(path + "."):
                head = p[len(path) + 1 :].split(".", 1)[0]
                if head.isdigit():
                    return int(head)
        return None

    def _layout(self, stack: Stack) -> dict:
        """The stack's kept layers (nodes in order), checked: the last is the one before it
        renamed, the two contiguous, names counting up by one step per layer."""
        nodes = [n for n in self.graph.nodes if n.op == "call_function"]
        layers: dict[int, list[fx.Node]] = {i: [] for i in range(KEEP)}
        where = {}
        for pos, n in enumerate(nodes):
            i = self._layer_of(n, stack.path)
            if i is not None:
                layers[i].append(n)
                where[n] = pos
        a, b = KEEP - 2, KEEP - 1
        prev, la, lb = layers[a - 1], layers[a], layers[b]
        if not la or len(la) != len(lb):
            raise _Mismatch
        span = [where[n] for n in la + lb]
        if span != list(range(span[0], span[0] + len(span))):  # ops in between, or out of order
            raise _Mismatch
        # Layer b must be layer a with each value of the layer before read from the one after.
        shift = {**dict(_paired(prev, la)), **dict(zip(la, lb))}
        stride: dict[str, int] = {}
        for na, nb in zip(la, lb):
            if na.target != nb.target or not _same_value(na.meta.get("val"), nb.meta.get("val")):
                raise _Mismatch
            if _renamed_stack(na, stack.path, a, b) != nb.meta.get("nn_module_stack"):
                raise _Mismatch
            want = self._map_args((na.args, na.kwargs), shift, stack.path, a, b)
            if not _equal(want, (nb.args, nb.kwargs)):
                raise _Mismatch
            (base, ca), (base_b, cb) = _base(na.name), _base(nb.name)
            if base != base_b or stride.setdefault(base, cb - ca) != cb - ca or cb <= ca:
                raise _Mismatch
        return {"stack": stack, "a": la, "b": lb, "stride": stride}

    def _map_args(self, args, shift: dict, path: str, a: int, b: int):
        """Args of a layer-a node as a layer-b node reads them."""

        def one(n: fx.Node):
            if n in shift:
                return shift[n]
            if n.op == "placeholder":
                target = self.specs[n.name].target if n.name in self.specs else None
                moved = _moved(target, path, a, b) if target else None
                if moved is not None:
                    spec = self.by_target.get(moved)
                    if spec is None:
                        raise _Mismatch
                    return self.placeholder[spec.arg.name]
            return n

        return fx.node.map_arg(args, one)

    # --- the whole program ---
    def _build(self, layouts: list[dict]) -> torch.export.ExportedProgram:
        old_specs = self.program.graph_signature.input_specs
        params, buffers = self.cut_order
        lifted = [s.target for s in old_specs if s.kind in (InputKind.PARAMETER, InputKind.BUFFER)]
        if lifted != params + buffers:  # the order of the lifted inputs is as we know it
            raise _Mismatch
        for s in old_specs:
            if s.kind in _PREFIX and s.arg.name != placeholder_name(s.kind, s.target):
                raise _Mismatch
        full_params, full_buffers = _input_order(self.model)
        specs, kinds = [], {s.target: s for s in old_specs if s.target}
        for kind, names in ((InputKind.PARAMETER, full_params), (InputKind.BUFFER, full_buffers)):
            for target in names:
                specs.append(self._spec(kind, target, kinds, layouts))
        specs += [s for s in old_specs if s.kind not in _PREFIX]

        new = fx.Graph()
        env: dict[fx.Node, fx.Node] = {}
        holders: dict[str, fx.Node] = {}
        old_holders = {n.name: n for n in self.graph.nodes if n.op == "placeholder"}
        for s in specs:
            old = old_holders.get(s.arg.name)
            node = new.placeholder(s.arg.name)
            if node.name != s.arg.name:
                raise _Mismatch
            if old is not None:
                node.meta = dict(old.meta)
                env[old] = node
            else:  # a copied layer's weight: the kept layer's, renamed
                node.meta = dict(old_holders[self.template_of[s.arg.name]].meta)
            holders[s.arg.name] = node
        shifts = {}  # base -> how far names of that base move in what follows a stack
        redirect: dict[fx.Node, fx.Node] = {}  # last kept layer's nodes -> the last copy's
        lasts = {id(lay["b"][-1]): lay for lay in layouts}
        for n in self.graph.nodes:
            if n.op == "placeholder":
                continue
            args = fx.node.map_arg((n.args, n.kwargs), lambda x: redirect.get(x) or env[x])
            if n.op == "output":
                new.output(args[0][0]).meta = dict(n.meta)
                continue
            base, count = _base(n.name)
            name = _named(base, count + shifts.get(base, 0))
            env[n] = self._node(new, n, args, name, n.meta)
            lay = lasts.get(id(n))
            if lay is not None:
                last = self._copies(new, lay, env, holders, shifts, redirect)
                redirect.update(zip(lay["b"], last))
                extra = lay["stack"].layers - KEEP
                for base, step in lay["stride"].items():
                    shifts[base] = shifts.get(base, 0) + extra * step
        out_specs = [
            OutputSpec(o.kind, TensorArgument((redirect.get(n) or env[n]).name), o.target)
            if isinstance(o.arg, TensorArgument) and (n := self._node_named(o.arg.name))
            else o
            for o in self.program.graph_signature.output_specs
        ]
        new.lint()
        gm = _make_graph_module(self.program.graph_module, new)  # lazy where the trace says so
        tensors = {
            **dict(self.model.named_parameters(remove_duplicate=False)),
            **dict(self.model.named_buffers(remove_duplicate=False)),
        }
        state = {  # what torch.export keeps: parameters and persistent buffers
            s.target: tensors[s.target]
            for s in specs
            if s.kind == InputKind.PARAMETER or (s.kind == InputKind.BUFFER and s.persistent)
        }
        return torch.export.ExportedProgram(
            root=gm,
            graph=gm.graph,
            graph_signature=ExportGraphSignature(input_specs=specs, output_specs=out_specs),
            state_dict=state,
            range_constraints=self.program.range_constraints,
            module_call_graph=self._call_graph(layouts),
            example_inputs=self.program.example_inputs,
            constants=self.program.constants,
            verifiers=self.program.verifiers,
        )

    def _node_named(self, name: str) -> fx.Node | None:
        return next((n for n in self.graph.nodes if n.name == name), None)

    def _spec(self, kind: InputKind, target: str, kept: dict, layouts) -> InputSpec:
        """A lifted input of the whole model: the cut export's, or the last kept layer's
        renamed for a copy."""
        if target in kept:
            return kept[target]
        for lay in layouts:
            s = lay["stack"]
            k = _layer_index(target, s.path)
            if k is not None and k >= KEEP:
                template = kept.get(_moved(target, s.path, k, KEEP - 1))
                if template is None or template.kind != kind:
                    raise _Mismatch
                arg = TensorArgument(placeholder_name(kind, target))
                self.template_of[arg.name] = template.arg.name
                return InputSpec(kind, arg, target, template.persistent)
        raise _Mismatch

    def _copies(self, new: fx.Graph, lay: dict, env, holders, shifts, redirect) -> list[fx.Node]:
        """Layers KEEP .. of the stack after its last kept one; the last copy's nodes. What
        they read of an earlier stack's last kept layer is that stack's last copy's
        (`redirect`: BART's decoder reads its encoder's last layer, no norm after it)."""
        s, lb = lay["stack"], lay["b"]
        b = KEEP - 1
        mine = {n: x for x, n in enumerate(lb)}  # the kept layer's ops: the copy's own
        before = {n: x for x, n in enumerate(lay["a"])}  # the layer before: the copy before
        last = [env[n] for n in lb]
        for k in range(KEEP, s.layers):
            made: list[fx.Node] = []

            def read(n: fx.Node, k=k, made=made, prior=last):
                if n in mine:
                    return made[mine[n]]
                if n in before:
                    return prior[before[n]]
                spec = self.specs.get(n.name) if n.op == "placeholder" else None
                moved = _moved(spec.target, s.path, b, k) if spec is not None else None
                if moved is not None:  # the kept layer's weight: the copy's
                    return holders[placeholder_name(spec.kind, moved)]
                return redirect.get(n) or env[n]

            for n in lb:
                base, count = _base(n.name)
                name = _named(base, count + shifts.get(base, 0) + (k - b) * lay["stride"][base])
                args = fx.node.map_arg((n.args, n.kwargs), read)
                meta = {**n.meta, "nn_module_stack": _renamed_stack(n, s.path, b, k)}
                made.append(self._node(new, n, args, name, meta))
            last = made
        return last

    @staticmethod
    def _node(new: fx.Graph, n: fx.Node, args, name: str, meta: dict) -> fx.Node:
        node = new.create_node(n.op, n.target, args[0], args[1], name=name)
        if node.name != name:  # taken: the names would not be the whole export's
            raise _Mismatch
        node.meta = dict(meta)
        return node

    def _call_graph(self, layouts) -> list:
        """The cut export's module calls with the copied layers' after the last kept one's."""
        entries = list(self.program.module_call_graph)
        for lay in layouts:
            s = lay["stack"]
            here = f"{s.path}.{KEEP - 1}"
            mine = [e for e in entries if e.fqn == here or e.fqn.startswith(here + ".")]
            if not mine:
                continue
            at = entries.index(mine[-1]) + 1
            copies = [
                type(e)(fqn=_moved(e.fqn, s.path, KEEP - 1, k), signature=e.signature)
                for k in range(KEEP, s.layers)
                for e in mine
            ]
            entries[at:at] = copies
        return entries


def _paired(prev: list[fx.Node], la: list[fx.Node]) -> list[tuple[fx.Node, fx.Node]]:
    """The layer before's ops paired with layer a's, one for one where the two are alike. A
    stack's first layer may have ops of its own (T5's computes the position bias the others
    read): layer a's ops are then paired with the first layer's same ops in order, and the
    extra ones stay unpaired (what reads them reads them as they are). Layer a with an op the
    layer before lacks: no pairing shows the stack repeats."""
    if len(prev) == len(la):
        return list(zip(prev, la))
    matcher = difflib.SequenceMatcher(
        a=[str(n.target) for n in prev], b=[str(n.target) for n in la], autojunk=False
    )
    pairs = [(prev[i + k], la[j + k]) for i, j, size in matcher.get_matching_blocks()
             for k in range(size)]  # fmt: skip
    if len(pairs) != len(la):
        raise _Mismatch
    return pairs


def _layer_index(name: str, path: str) -> int | None:
    """The layer of stack `path` that a dotted name lies in, if any."""
    if not name.startswith(path + "."):
        return None
    head = name[len(path) + 1 :].split(".", 1)[0]
    return int(head) if head.isdigit() else None


def _moved(name: str, path: str, a: int, b: int) -> str | None:
    """`name` of layer a of stack `path` as layer b's ('m.h.2.attn.w' -> 'm.h.3.attn.w')."""
    if _layer_index(name, path) != a:
        return None
    return f"{path}.{b}" + name[len(f"{path}.{a}") :]


def _renamed_stack(n: fx.Node, path: str, a: int, b: int) -> dict:
    """A node's module stack as the same op's in layer b (it is in layer a)."""
    out = {}
    for key, (p, t) in (n.meta.get("nn_module_stack") or {}).items():
        moved = _moved(p, path, a, b)
        if moved is not None:
            key = key[: len(key) - len(p)] + moved if key.endswith(p) else key
            p = moved
        out[key] = (p, t)
    return out


def _same_value(x, y) -> bool:
    if isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor):
        return (x.shape, x.dtype, x.stride(), x.device, x.requires_grad) == (
            y.shape,
            y.dtype,
            y.stride(),
            y.device,
            y.requires_grad,
        )
    if isinstance(x, (tuple, list)) and isinstance(y, (tuple, list)):
        return len(x) == len(y) and all(_same_value(p, q) for p, q in zip(x, y))
    return type(x) is type(y) and (x == y if isinstance(x, _PLAIN) else True)


def _equal(x, y) -> bool:
    """Arguments equal, nodes by identity."""
    if isinstance(x, fx.Node) or isinstance(y, fx.Node):
        return x is y
    if isinstance(x, (tuple, list)) and isinstance(y, (tuple, list)):
        return type(x) is type(y) and len(x) == len(y) and all(map(_equal, x, y))
    if isinstance(x, dict) and isinstance(y, dict):
        return x.keys() == y.keys() and all(_equal(x[k], y[k]) for k in x)
    return type(x) is type(y) and x == y
