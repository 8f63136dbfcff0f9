"""1F1B with a flush (PipeDream-Flush, PipeDream-2BW §3.2): depth + 1 forwards, then one
backward / one forward, every stage steps together after the step's last backward.

The loss stage runs its backward right after its forward, so it keeps its activations
instead of recomputing; the others hold the inputs of min(m, depth + 1) micro-batches.
"""

from __future__ import annotations

from .base import Schedule, StageInfo, StagePolicy, flushed


def policy(st: StageInfo, m: int, gpus: int) -> StagePolicy:
    return StagePolicy(recompute=not st.is_last, in_flight=min(m, st.depth + 1))


SCHEDULE = Schedule("1f1b", flushed, policy, synchronous=True, doc="1F1B with a flush per step")
