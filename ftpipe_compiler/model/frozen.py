"""Frozen parameters and LoRA at compile time: what `--freeze` and `--lora` do to the model.

    model = adapted(LossModel(net, inputs), freeze="encoder.block.[0-9].*", lora=None)
    describe_frozen(graph)   # "frozen: 132 tensors, 35.4 M of 60.5 M parameters (encoder.block.0 ...)"

The model is wrapped (peft, `ftpipe_runtime.models.lora`) and frozen before it is traced,
so `requires_grad` says it all from there on: the traced graph marks frozen weights
(`Param.frozen`) and the values no gradient reaches (`Node.requires_grad`), the costs give
them no weight-gradient compute (costs.py), the memory model no gradient or optimizer state
(formulas.param_bytes), the plan records them (`PlanParam.frozen`), and a stage that
nothing trainable feeds runs forwards only. A `module:function` model's own `requires_grad`
counts the same way.
"""

from __future__ import annotations

import re

from ftpipe_runtime.models.lora import LoraSpec, base_name, is_adapter, wrap
from ftpipe_runtime.spec.weights import WRAPPER_PREFIX

from ..errors import FtpipeError

__all__ = ["adapted", "base_names", "describe_frozen", "freeze_matching", "parse_lora"]


def parse_lora(text: str | None) -> dict | None:
    """--lora's text as the LoraSpec JSON a ModelSpec keeps; FtpipeError on bad text."""
    if not text:
        return None
    try:
        return LoraSpec.parse(text).to_json()
    except ValueError as e:
        raise FtpipeError(f"--lora: {e}") from None


def adapted(model, freeze: str = "", lora: dict | None = None):
    """`model` (a LossModel or FunctionModel: the network is `model.m`) with LoRA adapters
    and the weights matching `freeze` frozen. FtpipeError when they leave nothing to train."""
    if lora:
        try:
            model.m = wrap(model.m, lora)
        except (ValueError, ImportError) as e:
            raise FtpipeError(str(e)) from None
    if freeze:
        freeze_matching(model, freeze)
    if (freeze or lora) and not any(p.requires_grad for p in model.parameters()):
        raise FtpipeError(
            "every parameter of the model is frozen, so there is nothing to train; freeze fewer"
        )
    return model


def freeze_matching(model, pattern: str) -> list[str]:
    """Freeze every tensor one of whose names matches `pattern` from its start (re.match);
    the names frozen. FtpipeError when the pattern is not a regex or matches nothing."""
    try:
        found = re.compile(pattern)
    except re.error as e:
        raise FtpipeError(f"--freeze {pattern!r} is not a regular expression ({e})") from None
    frozen = []
    for name, p in model.named_parameters(remove_duplicate=False):
        name = name.removeprefix(WRAPPER_PREFIX)
        if found.match(name) and p.requires_grad:
            p.requires_grad_(False)
            frozen.append(name)
    if not frozen:
        names = [n.removeprefix(WRAPPER_PREFIX) for n, _ in model.named_parameters()]
        raise FtpipeError(
            f"--freeze {pattern!r} matches no parameter (matched from the start of the name); "
            f"the model's parameters are named like {', '.join(names[:3])}"
        )
    return frozen


def base_names(net) -> dict[str, str]:
    """A peft-wrapped network's parameter -> its name in the base model's checkpoint
    (`base_model.model.x.q_proj.base_layer.weight` -> `x.q_proj.weight`); adapters have none."""
    out = {}
    for name, _ in net.named_parameters(remove_duplicate=False):
        if not is_adapter(name):
            out[name] = base_name(name)
    return out


def describe_frozen(graph) -> str | None:
    """One line on what is frozen in a traced graph (None: nothing)."""
    frozen = [p for p in graph.params if p.frozen]
    if not frozen:
        return None
    total = sum(_numel(p) for p in graph.params if p.trainable or p.frozen)
    n = sum(_numel(p) for p in frozen)
    prefixes = list(dict.fromkeys(_prefix(p.name) for p in frozen))
    shown = ", ".join(prefixes[:6]) + (
        f" and {len(prefixes) - 6} more" if len(prefixes) > 6 else ""
    )
    return (
        f"frozen: {len(frozen)} tensors, {n / 1e6:,.1f} M of {total / 1e6:,.1f} M parameters "
        f"({shown})"
    )


def _numel(p) -> int:
    out = 1
    for s in p.shape:
        out *= s
    return out


def _prefix(name: str) -> str:
    """`encoder.block.3.layer.0.SelfAttention.q.weight` -> `encoder.block.3`: the name up to
    its first number (a layer), or without its last part."""
    parts = name.split(".")
    for i, part in enumerate(parts):
        if part.isdigit():
            return ".".join(parts[: i + 1])
    return ".".join(parts[:-1]) or name
