"""ZB-H1 (Qi et al., ICLR'24 §3.1, "ZB1P"): 1F1B with each backward split in two and the
weight passes deferred into what would be the pipeline's drain.

B (input gradients) stays where 1F1B puts its backward, so gradients reach upstream stages
sooner; W of micro-batch i comes after B of i + lag, lag = P - 1 - depth (the stage's
position in a chain of P), and the W's still due fill the tail. With equal F, B and W times
the bubble is (p - 1)(T_F + T_B - T_W) per step: a third of 1F1B's (p - 1)(T_F + T_B + T_W).

Memory (W deferred keeps activations longer): a micro-batch's autograd graph lives until its
W, so every stage holds min(m, P) micro-batches (1F1B's first stage's count, on every stage),
the loss stage its full activations for each (it does not recompute, as in 1F1B); a
recomputing stage holds the inputs of those and the rebuilt activations of the up to
min(m, lag + 1) whose B ran and W has not. Synchronous: every stage steps after its last W.
"""

from __future__ import annotations

from .base import Schedule, StageInfo, StagePolicy, one_f_one_b


def policy(st: StageInfo, m: int, gpus: int) -> StagePolicy:
    lag = max(gpus - 1 - st.depth, 0)
    warmup = min(m, st.depth + 1)
    return StagePolicy(
        recompute=not st.is_last,
        in_flight=min(m, warmup + lag),
        split=True,
        deferred=min(m, lag + 1),
    )


def stream(st: StageInfo, policy: StagePolicy, m: int, steps: int):
    lag, warmup = policy.deferred - 1, min(m, st.depth + 1)
    rec = policy.recompute
    return [a for k in range(steps) for a in one_f_one_b(st, k * m, m, warmup, rec, m, lag)]


SCHEDULE = Schedule("zb1p", stream, policy, synchronous=True, doc="ZB-H1: 1F1B, W deferred")
