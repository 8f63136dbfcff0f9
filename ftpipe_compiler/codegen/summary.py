"""What a stage holds, in words a reviewer scans: `encoder.block.0-2 (T5Block)`."""

from __future__ import annotations

import re

from ..graph.granularity import layer_key
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
    held = {st.id: held_layers(st) for st in stages}
    owners: dict[str, set[int]] = {}
    for sid, layers in held.items():
        for key, _ in layers:
            owners.setdefault(key, set()).add(sid)
    out = {}
    for sid, layers in held.items():
        runs: list[list] = []  # [prefix, first, last, type, part]
        for key, mtype in layers:
            part = len(owners[key]) > 1
            m = re.fullmatch(r"(.*\.)(\d+)", key)
            if (
                m
                and runs
                and not part
                and not runs[-1][4]
                and runs[-1][0] == m.group(1)
                and runs[-1][3] == mtype
                and runs[-1][2] == int(m.group(2)) - 1
            ):
                runs[-1][2] += 1
                continue
            if m:
                runs.append([m.group(1), int(m.group(2)), int(m.group(2)), mtype, part])
            else:
                runs.append([key or "top level", None, None, mtype, part])
        out[sid] = [_words(*r) for r in runs]
    return out


def _words(prefix, first, last, mtype, part) -> str:
    if first is None:
        name = prefix
    elif first == last:
        name = f"{prefix}{first}"
    else:
        name = f"{prefix}{first}-{last}"
    return name + (f" ({mtype})" if mtype else "") + (" (part)" if part else "")
