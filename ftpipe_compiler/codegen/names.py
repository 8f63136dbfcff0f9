"""Readable variable names for traced values, from the module scope that computed them.

    encoder.block.3.layer.0.SelfAttention.q   (Linear)      -> enc3_attn_q
    encoder.block.3.layer.1.layer_norm        (T5LayerNorm) -> enc3_ln_rsqrt
    transformer.h.0.attn                      (GPT2Attention, split) -> h0_attn_split

The first numbered container index stays (the block number a reviewer looks for); deeper
indices are dropped because the names after them already say what the module is. Names are
made unique with a `_2`, `_3`... suffix.
"""

from __future__ import annotations

import builtins
import keyword
import re

from torch import fx

from ..graph.exported import scope_of
from .source import identifier

# Whole-part abbreviations; every other part is lower-cased and kept.
ABBREVIATIONS = {
    "encoder": "enc",
    "decoder": "dec",
    "selfattention": "attn",
    "self_attn": "attn",
    "attention": "attn",
    "encdecattention": "xattn",
    "crossattention": "xattn",
    "encoder_attn": "xattn",
    "densereludense": "ff",
    "feed_forward": "ff",
    "layer_norm": "ln",
    "layernorm": "ln",
    "final_layer_norm": "ln_f",
    "relative_attention_bias": "relbias",
    "embed_tokens": "embed",
    "embeddings": "emb",
    "dropout": "drop",
    "intermediate": "inter",
}
# Parts that only wrap the real model: they add length, not meaning.
DROPPED = {"m", "transformer", "bert", "model", "self", "roberta", "base_model"}
# Names generated code uses for itself.
RESERVED = {"self", "tensors", "device", "torch", "aten", "operator", "nn"}


def module_stack(n: fx.Node) -> list[tuple[str, str]]:
    """[(scope, module type name)] from the outermost module to the innermost."""
    out = []
    for path, mtype in (n.meta.get("nn_module_stack") or {}).values():
        name = mtype if isinstance(mtype, str) else getattr(mtype, "__qualname__", str(mtype))
        out.append((scope_of(path), name.rsplit(".", 1)[-1]))
    return [(s, t) for s, t in out if s or t]


def abbreviate(scope: str) -> str:
    """'encoder.block.3.layer.0.SelfAttention.q' -> 'enc3_attn_q'."""
    words: list[str] = []
    numbered = False
    parts = scope.split(".") if scope else []
    for i, part in enumerate(parts):
        if part.isdigit():
            if not numbered:
                words.append((words.pop() if words else "v") + part)
                numbered = True
            continue
        if i + 1 < len(parts) and parts[i + 1].isdigit():
            # A container (`block` of `block.3`): the number joins the word before it, or the
            # container's own name when nothing precedes (GPT-2's `h.0` -> h0). Deeper
            # containers (`layer` of `layer.0` inside a block) are dropped with their index.
            if not numbered and not words:
                words.append(part.lower())
            continue
        if part.lower() in DROPPED:
            continue
        word = ABBREVIATIONS.get(part.lower(), _snake(part))
        if not words or words[-1] != word:
            words.append(word)
    return "_".join(w for w in words if w)


def weight_base(name: str) -> str:
    """The variable a received weight is read into: 'transformer.wte.weight' -> 'wte_weight'."""
    scope, _, leaf = name.rpartition(".")
    return "_".join(w for w in (abbreviate(scope), leaf) if w)


def _snake(part: str) -> str:
    return re.sub(r"(?<=[a-z0-9])(?=[A-Z])", "_", part).lower()


def op_word(target) -> str:
    """Short name of an fx call target: aten.__and__.Tensor -> 'and', aten.add_.Tensor -> 'add'."""
    name = getattr(target, "__name__", str(target))
    name = name.split(".")[0]  # OpOverload.__name__ is 'linear.default'
    return name.strip("_") or "op"


class Namer:
    """Hands out unique Python identifiers."""

    def __init__(self, taken=()):
        self.taken = set(RESERVED) | set(taken)

    def fresh(self, base: str) -> str:
        base = identifier(base)
        if keyword.iskeyword(base) or hasattr(builtins, base):
            base += "_"
        name, k = base, 1
        while name in self.taken:
            k += 1
            name = f"{base}_{k}"
        self.taken.add(name)
        return name


def value_base(n: fx.Node) -> str:
    """The name stem of a traced value: scope abbreviation, plus the op where it helps;
    "" outside any named module (the traced name, `mul_27`, is as good as any there)."""
    stack = module_stack(n)
    scope, mtype = stack[-1] if stack else ("", "")
    prefix = abbreviate(scope)
    op = op_word(n.target)
    # A torch.nn leaf (Linear, Embedding, LayerNorm...) computes one thing: its scope names it.
    if prefix and _is_torch_leaf(n) and op not in ("view", "reshape", "to", "contiguous"):
        return prefix
    return f"{prefix}_{op}" if prefix else ""


def _is_torch_leaf(n: fx.Node) -> bool:
    stack = n.meta.get("nn_module_stack") or {}
    if not stack:
        return False
    mtype = list(stack.values())[-1][1]
    qual = mtype if isinstance(mtype, str) else f"{mtype.__module__}.{mtype.__qualname__}"
    return qual.startswith("torch.nn.")
