"""Analytic costs: FLOPs and bytes of every traced op, turned into times by a roofline.

    graph = analytic_costs(traced, get_hardware("rtx2080ti"))

FLOPs come from `torch.utils.flop_counter.FlopCounterMode`, each op run on `meta` tensors
shaped as traced (no memory), once per distinct op and input shapes. An op runs at the hardware's
peak for its output dtype (bf16 / fp16 tensor cores for a model traced in 16 bits). Bytes moved are the bytes
an op reads and writes; view ops move nothing. Backward costs twice the forward unless
the op needs no gradient; recompute costs one forward.

The backward is split by FLOPs between input gradients (B) and weight gradients (W, what a
zero-bubble schedule defers): an op reading trainable weights and an activation that carries
gradient computes dX and dW, one forward's FLOPs each (a matmul: G Wᵀ and Xᵀ G), so half its
backward is W; an op reading weights but no such activation (an embedding lookup) is all W;
an op without weights all B. An op whose weights are all frozen computes only dX: its
backward costs one forward, all B; an op no gradient reaches (everything before it frozen)
has no backward and keeps no activation.
"""

from __future__ import annotations

import math
from dataclasses import replace

import torch
from torch import fx
from torch.utils.flop_counter import FlopCounterMode, flop_registry, register_flop_formula

from ..graph.exported import VIEW_OPS, map_tensors, retarget
from ..graph.fuse import FUSED_OP, logits_bytes, register
from ..graph.granularity import collapse
from ..graph.opgraph import OpGraph
from ..graph.trace import Traced
from .hardware import Hardware
from .saved import saved_bytes

BACKWARD_FACTOR = 2.0


def count_flops(traced: Traced) -> dict[str, float]:
    """Forward FLOPs of every traced node: its op run on `meta` tensors shaped as its inputs
    were traced, under FlopCounterMode, once per distinct op and input shapes (a stack of
    alike layers repeats the same few dozen)."""
    register()  # the fused head's FLOPs formula
    _register_grouped_mm(n.target for n in traced.program.graph.nodes if n.op == "call_function")
    counter = FlopCounterMode(display=False)
    meta = torch.device("meta")
    flops: dict[str, float] = {}
    seen: dict[tuple, float] = {}
    with counter, torch.no_grad():
        for n in traced.program.graph.nodes:
            if n.op != "call_function":
                continue
            key = (n.target, repr(fx.node.map_arg((n.args, n.kwargs), _described)))
            if key not in seen:
                args, kwargs = fx.node.map_arg((n.args, n.kwargs), _on_meta)
                # A program traced on a real device bakes that device into factory calls.
                args, kwargs = retarget(args, kwargs, meta)
                before = counter.get_total_flops()
                n.target(*args, **kwargs)
                seen[key] = float(counter.get_total_flops() - before)
            flops[n.name] = seen[key]
    return flops


# Grouped matrix products (a mixture of experts: each token's rows times its expert's matrix)
# that torch's FLOP counter does not know: torch's own, and transformers' fallback for where
# torch's has no kernel (traced in fp32), which computes the same.
GROUPED_MM = ("aten::_grouped_mm", "transformers::grouped_mm_fallback")


def _grouped_mm_flops(a_shape, b_shape, *args, out_shape=None, **kwargs) -> int:
    """2 x the multiply-adds: rows of `a` (S x K, split into groups) times their group's
    K x N matrix of `b` (G x K x N) make S x N; batched (a: G x M x K), every output element
    is a K-long dot product; two 2-d operands split along K make G x M x N from M x K by K x N."""
    if len(a_shape) == 2 and len(b_shape) == 2:
        return 2 * a_shape[0] * a_shape[1] * b_shape[-1]
    if len(a_shape) == 2:
        return 2 * a_shape[0] * a_shape[1] * out_shape[-1]
    return 2 * math.prod(out_shape) * a_shape[-1]


def _register_grouped_mm(targets) -> None:
    """`_grouped_mm_flops` for the grouped products among these ops, once per process."""
    for t in set(targets):
        schema = getattr(t, "_schema", None)
        if schema is not None and schema.name in GROUPED_MM:
            if t.overloadpacket not in flop_registry:
                register_flop_formula(t.overloadpacket)(_grouped_mm_flops)


def _described(n: fx.Node):
    """What an input's FLOPs can depend on: its shape and dtype (values: as they are)."""
    return map_tensors(n.meta.get("val"), lambda t: ("tensor", tuple(t.shape), t.dtype))


def _on_meta(n: fx.Node):
    """An empty `meta` tensor (or structure of them) like the traced input."""
    return map_tensors(
        n.meta.get("val"),
        lambda t: torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta"),
    )


def weight_share(graph: OpGraph, n) -> float:
    """The fraction of a node's backward that computes weight gradients (see the top)."""
    if not any(graph.param[p].trainable for p in n.params):
        return 0.0
    carries = any(graph.node[p].requires_grad for p in graph.preds[n.id])
    return 0.5 if carries else 1.0


def backward_factor(graph: OpGraph, n) -> float:
    """Backward FLOPs (and bytes) per forward one: no weight gradients for frozen weights."""
    weights = [graph.param[p] for p in n.params]
    if any(p.frozen for p in weights) and not any(p.trainable for p in weights):
        return BACKWARD_FACTOR - 1.0
    return BACKWARD_FACTOR


def analytic_costs(traced: Traced, hw: Hardware, granularity: str = "op") -> OpGraph:
    graph = traced.graph
    flops = count_flops(traced)
    kept = saved_bytes(traced, hw.host.device_is_host)
    input_bytes = {i.name: i.bytes for i in graph.inputs}
    nodes = []
    for n in graph.nodes:
        f = sum(flops.get(m, 0.0) for m in n.members)
        view = n.op in VIEW_OPS
        read = (
            sum(graph.node[p].out_bytes for p in graph.preds[n.id])
            + sum(graph.param[p].bytes for p in n.params)
            + sum(input_bytes[i] for i in n.inputs)
        )
        moved = 0.0 if view else float(read + n.out_bytes)
        act = sum(kept.get(m, 0) for m in n.members)
        if n.op == FUSED_OP:  # its logits are no node's output: written and read
            moved += 2 * logits_bytes(graph, n)[0]
        # A matmul computing in bf16 makes bf16: its output dtype says which peak it runs at.
        fwd = 0.0 if view else hw.op_time(f, moved, n.dtype)
        k = backward_factor(graph, n)
        bwd = 0.0 if (view or not n.requires_grad) else hw.op_time(k * f, k * moved, n.dtype)
        nodes.append(
            replace(
                n,
                flops=f,
                bytes_moved=moved,
                fwd_s=fwd,
                bwd_s=bwd,
                wgrad_s=bwd * weight_share(graph, n),
                # Nothing to recompute where no gradient flows (a frozen prefix, masks).
                recompute_s=fwd if n.requires_grad else 0.0,
                act_bytes=act,
            )
        )
    costed = graph.with_nodes(nodes, profile="analytic", hardware=hw.name)
    return collapse(costed) if granularity == "layer" else costed
