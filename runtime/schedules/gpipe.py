"""GPipe (Huang et al., NeurIPS'19): all forwards of a step, then all backwards, then a flush.

Every stage recomputes (re-materialisation) and holds the inputs of all m micro-batches.
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
    return StagePolicy(recompute=True, in_flight=m)


SCHEDULE = Schedule("gpipe", stream, policy, synchronous=True, doc="GPipe: F all, B all, flush")
