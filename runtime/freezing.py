"""PipeTransformer's freeze algorithm: how many bottom layers are frozen after each decision.

    frozen_bound(frozen=8, layers=24, alpha=1/3)            # 13: at most this many after
    next_frozen(frozen=8, norms=[...24 norms...], alpha=1/3)  # eq. 1
    bound_schedule(layers=24, alpha=1/3, decisions=3)       # (8, 13, 16): the fastest it may go
    units = layer_units(param_names)                        # the parameters of each layer

He et al., "PipeTransformer", ICML'21, §3.1, eq. 1: at the T-th decision (T >= 1,
L_frozen^(0) = 0, alpha in (0, 1)), with g_l the gradient of layer l at that iteration,

    L_frozen^(T) = min(L_frozen^(T-1) + alpha (L - L_frozen^(T-1)),
                       argmin_{l in {L_frozen^(T-1), ..., L}} ||g_l^(T)||)

Layers are numbered from the input, 0 first, so layer l is preceded by l layers: the
gradient term freezes the layers *preceding* the layer of smallest gradient norm (Appendix
B: "freeze all layers preceding the ... layer" of smallest gradient norm, amended by the
bound), and the candidates are the active layers L_frozen^(T-1) ... L-1 (a frozen layer
has no gradient); the first active layer being the smallest freezes nothing more. The bound
is a count of layers: it is rounded down, so at most an alpha fraction of the active layers
is frozen at once. A norm that is not finite (a skipped fp16 step) counts as infinite.

A "layer" is one of the model's repeated blocks (`bert.encoder.layer.7`, `model.layers.7`,
`encoder.block.7`); what precedes the first block (the embeddings) freezes with it, and
what follows the last (the head) never freezes.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence

__all__ = ["bound_schedule", "frozen_bound", "layer_of", "layer_units", "next_frozen"]

_NUMBERED = re.compile(r"^(.*?\.)?(\d+)\.")


def frozen_bound(frozen: int, layers: int, alpha: float) -> int:
    """The upper bound of eq. 1, L_f + alpha (L - L_f), rounded down."""
    if not 0 < alpha < 1:
        raise ValueError(f"alpha must be between 0 and 1 (exclusive), not {alpha}")
    if not 0 <= frozen <= layers:
        raise ValueError(f"{frozen} frozen layers of {layers}")
    # the small margin keeps 8 + (1/3) * 15 = 12.999... from rounding down to 12
    return max(frozen, math.floor(frozen + alpha * (layers - frozen) + 1e-9))


def next_frozen(frozen: int, norms: Sequence[float], alpha: float) -> int:
    """Eq. 1: the frozen count after a decision, from the gradient norm of every layer
    (`norms[l]` for layer l; those of frozen layers are not looked at)."""
    layers = len(norms)
    bound = frozen_bound(frozen, layers, alpha)
    if frozen >= layers:
        return frozen
    active = [(n if math.isfinite(n) else math.inf, k) for k, n in enumerate(norms)][frozen:]
    smallest = min(active)[1]  # ties: the lowest layer
    return max(frozen, min(bound, smallest))


def bound_schedule(layers: int, alpha: float, decisions: int) -> tuple[int, ...]:
    """Frozen counts after decisions 1..`decisions` when the bound is always what limits
    (the gradient term never smaller): the most freezing alpha allows."""
    out, frozen = [], 0
    for _ in range(decisions):
        frozen = frozen_bound(frozen, layers, alpha)
        out.append(frozen)
    return tuple(out)


def layer_of(name: str) -> str | None:
    """`bert.encoder.layer.7.attention.self.query.weight` -> `bert.encoder.layer.7`; None for
    a parameter outside the repeated blocks."""
    m = _NUMBERED.match(name)
    return f"{m.group(1) or ''}{m.group(2)}" if m else None


def layer_units(names: Sequence[str]) -> list[list[str]]:
    """The parameters that freeze with each layer, in the order `names` first reach each
    layer (execution order when `names` is): parameters met before the first layer join
    layer 0, those after the last stay trainable and are in no unit."""
    units: dict[str, list[str]] = {}
    before: list[str] = []
    for name in names:
        key = layer_of(name)
        if key is None:
            if not units:
                before.append(name)
            continue
        units.setdefault(key, []).append(name)
    out = [list(v) for v in units.values()]
    if out:
        out[0] = before + out[0]
    return out
