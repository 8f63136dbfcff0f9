"""GPipe (Huang et al., NeurIPS'19): all forwards of a step, then all backwards, then a flush.

Every stage but the loss stage recomputes (re-materialisation) and holds the inputs of all
m micro-batches. The loss stage keeps its activations: its forwards' graphs are the ones the
backwards need first, and recomputing it (an LM head over the vocabulary is often the
largest stage) would lengthen the critical path by its whole forward per micro-batch. The
memory model counts its m micro-batches' activations, so a plan that cannot hold them does
not fit and another is chosen.
"""

from __future__ import annotations

from .actions import Action
from .base import Schedule, StageInfo, StagePolicy


def stream(st: StageInfo, policy: StagePolicy, m: int, steps: int) -> list[Action]:
    out = []
    for k in range(steps):
        mbs = range(k * m, (k + 1) * m)
        out += [Action("F", st.id, i) for i in mbs]
        out += [Action("B", st.id, i, policy.recompute) for i in reversed(mbs)]
        out.append(Action("S", st.id, k))
    return out


def policy(st: StageInfo, m: int, gpus: int) -> StagePolicy:
    return StagePolicy(recompute=not st.is_last, in_flight=m)


SCHEDULE = Schedule("gpipe", stream, policy, synchronous=True, doc="GPipe: F all, B all, flush")
