"""A model traced for packed documents (`--pack`) must mask its attention by them.

    check_documents_apart(spec, program)   # after torch.export; one sentence when it does not

Traced with position ids and no 2-D attention mask (ftpipe_runtime.models.packing), a model
keeps packed documents apart only if its attention reads a mask that transformers' masking
derived from those positions. Most families do (Llama, Mistral, Qwen, Gemma, Phi-3, GPT-2,
GPT-NeoX, Falcon...); some take position ids but build their mask without them (OPT), and
would silently let every token attend across documents. So the program itself is read: every
attention (a `scaled_dot_product_attention`, or an eager softmax over keys) must descend from
a [..., seq, seq] tensor computed from the position ids alone (no weight, no other input).
"""

from __future__ import annotations

import torch
from ftpipe_runtime.models.packing import POSITIONS
from torch import fx

from ..errors import TraceError

__all__ = ["check_documents_apart"]

_SDPA = torch.ops.aten.scaled_dot_product_attention.default
_SOFTMAX = (torch.ops.aten._softmax.default, torch.ops.aten.softmax.int)


def check_documents_apart(spec, program: torch.export.ExportedProgram) -> None:
    """Raise a TraceError unless every attention of `program` reads a mask made from the
    position ids alone (the inputs are `spec.inputs`, in order)."""
    specs = program.graph_signature.input_specs
    users = [s.arg.name for s in specs if s.kind.name == "USER_INPUT"]
    input_of = dict(zip(users, spec.inputs))
    read = {s.arg.name for s in specs if s.kind.name in ("PARAMETER", "BUFFER")} | set(users)
    seq = next(
        (n.meta["val"].shape[-1] for n in program.graph.nodes
         if n.op == "placeholder" and input_of.get(n.name) == POSITIONS),
        None,
    )  # fmt: skip
    pure: dict[fx.Node, bool] = {}  # computed from the positions alone (constants aside)
    other: dict[fx.Node, bool] = {}  # reads a weight or another input
    masked: dict[fx.Node, bool] = {}  # descends from a [..., seq, seq] positions-only tensor
    attention = []
    for n in program.graph.nodes:
        args = n.all_input_nodes
        if n.op == "placeholder":
            pure[n] = input_of.get(n.name) == POSITIONS
            other[n] = n.name in read and not pure[n]
            masked[n] = False
            continue
        other[n] = any(other[a] for a in args)
        pure[n] = not other[n] and any(pure[a] for a in args)
        val = n.meta.get("val")
        square = isinstance(val, torch.Tensor) and val.dim() == 4 and val.shape[-2:] == (seq, seq)
        masked[n] = (pure[n] and square) or any(masked[a] for a in args)
        if n.op == "call_function" and (n.target == _SDPA or (n.target in _SOFTMAX and square)):
            attention.append(n)
    unmasked = [n for n in attention if not masked[n]]
    if not attention or unmasked:
        raise TraceError(
            f"{spec.spec}: its attention does not read a mask made from position_ids, so packed "
            "documents would attend to each other; leave --pack out (--pack needs a family "
            "whose masks come from transformers' masking utilities, as Llama's, Qwen's, "
            "Mistral's or GPT-2's do)"
        )
