"""What a stage holds, in words a reviewer scans: `encoder.block.0-2 (T5Block)`."""

from __future__ import annotations

from ..graph.granularity import layer_key, layer_runs
from .names import module_stack
from .wiring import StageWiring

QUIET = {"Dropout"}


def held_layers(st: StageWiring) -> list[tuple[str, str]]:
    """(layer scope, module type) in order of first appearance in the stage."""
    seen: dict[str, str] = {}
    for n in st.nodes:
        stack = module_stack(n)
        scope = stack[-1][0] if stack else ""
        key = layer_key(scope)
        if key not in seen:
            types = dict(stack)
            seen[key] = types.get(key) or (stack[0][1] if stack and not key else "")
    # Dropout holds nothing and computes nothing worth a reviewer's attention.
    return [(k, t) for k, t in seen.items() if t not in QUIET]


def describe(stages: list[StageWiring]) -> dict[int, list[str]]:
    """Per stage, its layers with numbered runs merged; `(part)` where a layer is split."""
    return layer_runs({st.id: held_layers(st) for st in stages})
