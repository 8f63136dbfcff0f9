"""What autograd keeps for the backward, per traced node: the analytic profile's `act_bytes`.

    kept = saved_bytes(traced)        # {node name: bytes kept for its backward}

Each distinct op signature (target, inputs' shapes, strides, dtypes, which carry gradient,
other arguments) runs once on `meta` tensors under `saved_tensors_hooks` (a 3B model's few
hundred ops are a few dozen signatures), which records what its backward keeps: its output,
some of its inputs (a linear keeps its input, not its output), new tensors (a dropout's mask,
a layer norm's statistics) or nothing (an add, a cast). An op whose meta run would not keep
what a device's kernel keeps has a rule instead (`RULES`: SDPA runs the math fallback on
`meta`, which keeps the whole attention matrix; the fused kernels of CPU and GPU keep q, k, v,
the output and one log-sum-exp per query row).

Then every kept tensor counts once, whoever keeps it: a view counts its base, an op that
returns its input (a `to` of the same dtype) counts that input; parameters and buffers
count nowhere (the weights are counted apart). A tensor is charged to its producer where the
producer keeps it itself (a softmax), else to its first keeper: a stage that receives a
tensor and keeps it (the next layer's norm keeps the residual stream) holds it, the sending
stage, which keeps it for no op of its own, does not.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import fx

from ..graph.exported import VIEW_OPS, map_tensors, op_name, retarget, tensors_in
from ..graph.fuse import register
from ..graph.trace import Traced

aten = torch.ops.aten
META = torch.device("meta")


@dataclass(frozen=True)
class Kept:
    """What one op's backward keeps: outputs (flat positions), inputs (positions among its
    distinct tensor inputs), bytes of each new tensor; `aliases`: output -> the input whose
    memory it returns (the op made no copy)."""

    outputs: tuple[int, ...] = ()
    inputs: tuple[int, ...] = ()
    new: tuple[int, ...] = ()
    aliases: tuple[tuple[int, int], ...] = ()
    measured: bool = True  # False: the run failed and the whole output is assumed kept


def saved_bytes(traced: Traced, on_cpu: bool = False) -> dict[str, int]:
    """Bytes each graph node keeps for the backward (see the top), by node id; `on_cpu`:
    the device is a CPU (its kernels keep what a GPU's do, but for SDPA with dropout)."""
    register()  # the fused head runs on meta like any op
    graph, placeholders = traced.graph, traced.placeholders
    fx_nodes = {n.name: n for n in traced.program.graph.nodes}
    live = [fx_nodes[n.id] for n in graph.nodes if n.id in fx_nodes]
    grad = {n.id: n.requires_grad for n in graph.nodes}
    for name, (kind, what) in placeholders.items():
        p = graph.param.get(what) if kind == "param" else None
        grad[name] = bool(p and p.trainable)
    runs: dict[tuple, Kept] = {}
    kept: dict[str, Kept] = {}
    for n in live:
        if op_name(n.target) in VIEW_OPS:
            continue
        leaves = _distinct_inputs(n)
        key = _signature(n, leaves, grad)
        if key not in runs:
            runs[key] = _measure(n, leaves, grad, on_cpu)
        kept[n.name] = runs[key]
    return _charged(live, kept, placeholders)


def _charged(live: list[fx.Node], kept: dict[str, Kept], placeholders) -> dict[str, int]:
    """Every kept tensor's bytes once, on its producer if it keeps it, else its first keeper."""
    resolve = _Resolver(kept)
    keepers: dict[tuple, list[str]] = {}
    act = {n.name: 0 for n in live}
    for n in live:
        k = kept.get(n.name)
        if k is None:
            continue
        act[n.name] += sum(k.new)
        leaves = _distinct_inputs(n)
        tensors = [(n, i) for i in k.outputs] + [resolve(leaves[i]) for i in k.inputs]
        for t in dict.fromkeys(tensors):
            src = t[0]
            if src.op == "placeholder" and placeholders.get(src.name, ("",))[0] == "param":
                continue  # a weight or buffer: counted with the weights
            keepers.setdefault(t, []).append(n.name)
    for (src, i), who in keepers.items():
        at = src.name if src.name in who else who[0]
        act[at] += _bytes(src, i)
    return act


class _Resolver:
    """A graph tensor's identity: (the node whose memory it is, output position), through
    views and ops that return an input (`Kept.aliases`)."""

    def __init__(self, kept: dict[str, Kept]):
        self.kept = kept
        self.memo: dict[fx.Node, tuple] = {}

    def __call__(self, n: fx.Node, i: int = 0) -> tuple[fx.Node, int]:
        if (n, i) not in self.memo:
            self.memo[(n, i)] = self._resolve(n, i)
        return self.memo[(n, i)]

    def _resolve(self, n: fx.Node, i: int) -> tuple[fx.Node, int]:
        if n.op != "call_function":
            return n, i
        name = op_name(n.target)
        if name == "_operator.getitem":
            return self(n.args[0], n.args[1])
        if name in VIEW_OPS:  # split, chunk, unbind: every output a view of the input
            return self(n.args[0])
        k = self.kept.get(n.name)
        alias = dict(k.aliases) if k else {}
        if i in alias:
            return self(_distinct_inputs(n)[alias[i]])
        return n, i


def _bytes(n: fx.Node, i: int) -> int:
    val = n.meta.get("val")
    if isinstance(val, (tuple, list)):
        flat = tensors_in(val)
        val = flat[i] if i < len(flat) else None
    if not isinstance(val, torch.Tensor):
        return 0
    return val.numel() * val.element_size()


def _distinct_inputs(n: fx.Node) -> list[fx.Node]:
    found: list[fx.Node] = []
    fx.node.map_arg((n.args, n.kwargs), found.append)
    return list(dict.fromkeys(found))


def _signature(n: fx.Node, leaves: list[fx.Node], grad: dict) -> tuple:
    """What an op's kept tensors can depend on: its inputs' layout and gradients, its other
    arguments, and which arguments are the same tensor."""
    where = {a: i for i, a in enumerate(leaves)}

    def described(a: fx.Node):
        return map_tensors(
            a.meta.get("val"),
            lambda t: (tuple(t.shape), tuple(t.stride()), t.dtype, grad.get(a.name), where[a]),
        )

    return n.target, repr(fx.node.map_arg((n.args, n.kwargs), described))


def _measure(n: fx.Node, leaves: list[fx.Node], grad: dict, on_cpu: bool) -> Kept:
    """The op run once on `meta` tensors shaped as traced, its saved tensors recorded."""
    writes = _mutates(n.target)
    made = {a: _on_meta(a, grad.get(a.name, False), writes) for a in leaves}
    args, kwargs = fx.node.map_arg((n.args, n.kwargs), made.__getitem__)
    args, kwargs = retarget(args, kwargs, META)
    rule = RULES.get(n.target)
    ruled = rule(n, list(made.values()), on_cpu) if rule is not None else None
    if ruled is not None:
        return ruled
    owner = {}
    for i, a in enumerate(leaves):
        for t in tensors_in(made[a]):
            owner.setdefault(_storage(t), i)
    saved: list[torch.Tensor] = []  # held: a freed storage's id could be reused
    try:
        with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(saved.append, _same):
            out = tensors_in(n.target(*args, **kwargs))
    except Exception:  # an op meta cannot run: keep its output, the conservative guess
        return Kept(outputs=tuple(range(len(tensors_in(n.meta.get("val"))))), measured=False)
    outs = {}
    for i, t in enumerate(out):
        outs.setdefault(_storage(t), i)
    aliases = tuple((i, owner[_storage(t)]) for i, t in enumerate(out) if _storage(t) in owner)
    kept_out, kept_in, new = {}, {}, {}
    for t in saved:
        s = _storage(t)
        if s in outs:
            kept_out[outs[s]] = None
        elif s in owner:
            kept_in[owner[s]] = None
        else:
            new[s] = t.untyped_storage().nbytes()
    return Kept(tuple(kept_out), tuple(kept_in), tuple(new.values()), aliases)


def _sdpa(n: fx.Node, inputs: list, on_cpu: bool) -> Kept | None:
    """SDPA as the fused kernels keep it (flash on a CPU; flash, cuDNN or memory-efficient
    on a GPU): q, k, v, the output and one fp32 log-sum-exp per query row; a mask (an
    additive one as is; a boolean one turned into one in q's dtype, made anew by each call).
    None where a CPU runs the math fallback (with dropout): the meta run keeps what it does."""
    q, k, v, *rest = n.args
    named = dict(zip(("attn_mask", "dropout_p"), rest)) | n.kwargs
    mask = named.get("attn_mask")
    if on_cpu and named.get("dropout_p", 0.0) > 0:
        return None
    leaves = _distinct_inputs(n)
    if not any(t.requires_grad for t in inputs if isinstance(t, torch.Tensor)):
        return Kept()
    qv = q.meta["val"]
    lse = math.prod(qv.shape[:-1]) * 4
    new = [lse]
    keep = [leaves.index(x) for x in (q, k, v)]
    if isinstance(mask, fx.Node):
        mv = mask.meta["val"]
        if mv.dtype == torch.bool:
            new.append(mv.numel() * qv.element_size())
        else:
            keep.append(leaves.index(mask))
    return Kept(outputs=(0,), inputs=tuple(dict.fromkeys(keep)), new=tuple(new))


def _dropout(n: fx.Node, inputs: list, on_cpu: bool) -> Kept | None:
    """A GPU's fused dropout keeps a boolean mask; a CPU's (and `meta`'s) multiplies by a
    scaled noise tensor of the input's dtype, which the meta run keeps."""
    x, p, train = (*n.args, *[None] * 3)[:3]
    named = {"p": p, "train": train} | n.kwargs
    if on_cpu or not (inputs and inputs[0].requires_grad):
        return None
    if not named["train"] or not 0 < named["p"] < 1:
        return Kept()
    return Kept(new=(x.meta["val"].numel(),))


RULES = {
    aten.scaled_dot_product_attention.default: _sdpa,
    aten.dropout.default: _dropout,
}


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


def _same(t):
    return t


def _mutates(target) -> bool:
    schema = getattr(target, "_schema", None)
    return bool(schema) and any(a.alias_info and a.alias_info.is_write for a in schema.arguments)


def _on_meta(a: fx.Node, requires_grad: bool, writes: bool):
    def make(t):
        m = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=META)
        if not (requires_grad and t.is_floating_point()):
            return m
        # An op writing into its input needs a non-leaf, as in the traced forward.
        return m.requires_grad_().clone() if writes else m.requires_grad_()

    return map_tensors(a.meta.get("val"), make)
