"""PipeDream-2BW (Narayanan et al., ICML'21 §3.1): 1F1B without flushes, double-buffered weights.

Each stage runs one 1F1B stream across steps (min(m, depth + 1) forwards ahead) and
accumulates gradients over m micro-batches. A micro-batch of step k runs forward and
backward on the weights after max(k - 1, 0) steps of its stage, so the update is
W(t+1) = W(t) - lr * grad f(W(t-1)): at most two versions of a stage's weights are alive
(the newest, and the shadow its in-flight micro-batches started on). Steps are per stage,
no flush. Needs m >= depth + 1 to fill the pipe; fewer micro-batches leave bubbles.
"""

from __future__ import annotations

from .base import Schedule, StageInfo, StagePolicy, streamed


def policy(st: StageInfo, m: int, gpus: int) -> StagePolicy:
    return StagePolicy(
        recompute=not st.is_last,
        in_flight=min(m, st.depth + 1),
        weight_versions=2,
        weight_delay=1,
    )


SCHEDULE = Schedule("2bw", streamed, policy, synchronous=False, doc="PipeDream-2BW")
