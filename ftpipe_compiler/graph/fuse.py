"""Graph rewrites after tracing: the LM head and its loss become one op.

    fused = fuse_linear_cross_entropy(program.graph_module)   # how many were fused

`linear(h, W[, b]) -> [to(dtype)] -> view(-1, V) -> cross_entropy_loss(., target)` with the
default reduction (mean), weight and label smoothing, and no other use of the logits, becomes
`torch.ops.ftpipe.linear_cross_entropy(h, W, b, target, ignore_index, dtype)`
(`ftpipe_runtime.stage.fused_loss`): the same loss and gradients with one tokens x vocabulary
tensor instead of four. The profile then times the fused op and the generated stage calls
it, so plans, simulation and run agree. Heads with anything between the product and the loss (BART's
final logits bias) keep the unfused ops.
"""

from __future__ import annotations

import math

import torch
from ftpipe_runtime.stage import fused_loss
from torch import fx
from torch.utils.flop_counter import flop_registry, register_flop_formula

from .opgraph import dtype_bytes

__all__ = ["FUSED_OP", "fuse_linear_cross_entropy", "logits_bytes", "register"]

FUSED_OP = "ftpipe.linear_cross_entropy.default"  # an OpGraph node's op

aten = torch.ops.aten
_ASSERTS = {aten._assert_tensor_metadata.default}  # export's checks of a .to(): droppable


def _only_user(n: fx.Node) -> fx.Node | None:
    users = [u for u in n.users if u.target not in _ASSERTS]
    return users[0] if len(users) == 1 else None


def _match(loss: fx.Node):
    """(the nodes it replaces besides the loss, h, W, b, target, ignore_index, dtype) or
    None."""
    args = loss.args
    # weight, reduction (1: mean), ignore_index, label_smoothing: positional or keywords
    given = (*args[2:], *[None] * (4 - len(args[2:])))[:4]
    options = dict(zip(("weight", "reduction", "ignore_index", "label_smoothing"), given))
    options.update(loss.kwargs)
    if options["weight"] is not None or options["reduction"] not in (None, 1):
        return None
    if options["label_smoothing"] not in (None, 0.0):
        return None
    ignore = -100 if options["ignore_index"] is None else options["ignore_index"]
    view, target = args[0], args[1]
    if not isinstance(view, fx.Node) or view.target not in (
        aten.view.default,
        aten.reshape.default,
    ):
        return None
    cast, dtype = view.args[0], None
    if isinstance(cast, fx.Node) and cast.target == aten.to.dtype and len(cast.args) == 2:
        dtype, linear = cast.args[1], cast.args[0]
    else:
        linear, cast = cast, None
    if not isinstance(linear, fx.Node) or linear.target != aten.linear.default:
        return None
    chain = [n for n in (linear, cast, view) if n is not None]
    if any(_only_user(n) is not after for n, after in zip(chain, [*chain[1:], loss])):
        return None
    h, w, *b = linear.args
    return chain, h, w, (b[0] if b else None), target, ignore, dtype


def fuse_linear_cross_entropy(gm: fx.GraphModule) -> int:
    register()
    graph, fused = gm.graph, 0
    for loss in [n for n in graph.nodes if n.target == aten.cross_entropy_loss.default]:
        found = _match(loss)
        if found is None:
            continue
        chain, h, w, b, target, ignore, dtype = found
        with graph.inserting_before(loss):
            node = graph.call_function(
                torch.ops.ftpipe.linear_cross_entropy.default, (h, w, b, target, ignore, dtype)
            )
        # Where the op sits: the LM head's module (its layer at --granularity layer).
        node.meta = {**loss.meta, "nn_module_stack": chain[0].meta.get("nn_module_stack", {})}
        loss.replace_all_uses_with(node)
        graph.erase_node(loss)
        for n in reversed(chain):
            for a in [u for u in n.users if u.target in _ASSERTS]:
                graph.erase_node(a)
            graph.erase_node(n)
        fused += 1
    if fused:
        graph.lint()
        gm.recompile()
    return fused


def _flops(x_shape, w_shape, *args, out_shape=None, **kwargs) -> int:
    """The head's product, as FlopCounterMode counts linear: 2 x tokens x width x vocabulary."""
    return 2 * math.prod(x_shape[:-1]) * x_shape[-1] * w_shape[0]


def register() -> None:
    """The op (`fused_loss.register`) and its FLOPs formula, once per process: before a
    graph that holds it is made or counted."""
    fused_loss.register()
    if torch.ops.ftpipe.linear_cross_entropy not in flop_registry:
        register_flop_formula(torch.ops.ftpipe.linear_cross_entropy)(_flops)


def logits_bytes(graph, n) -> tuple[int, int]:
    """(logits, log-sum-exps) bytes of a fused head node: what it makes inside and keeps for
    backward, which no other node's output shows (analytic costs count them as moved and
    kept). The logits are tokens x vocabulary in the product's dtype, the hidden state's; one
    log-sum-exp per token in the loss's."""
    hidden = [graph.node[p] for p in graph.preds[n.id] if len(graph.node[p].shape) >= 2]
    if not hidden:
        return 0, 0
    tokens = math.prod(hidden[0].shape[:-1])
    vocab = max((graph.param[p].shape[0] for p in n.params), default=0)
    return tokens * vocab * dtype_bytes(hidden[0].dtype), tokens * dtype_bytes(n.dtype)
