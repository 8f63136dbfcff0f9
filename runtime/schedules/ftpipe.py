"""FTPipe's asynchronous schedule (§4.2, Fig. 5): depth + 1 forwards fill the pipe, then
backwards and forwards alternate forever; gradients accumulate over m backwards, no flush,
no weight stashing.

A forward reads the stage's weights as they are when it runs (stale by the steps its stage
took meanwhile), and a backward recomputes on the weights current at the backward, so no
second copy of the weights is kept. The loss stage does not recompute (§4.3): at depth 0
it runs each backward right after its forward, so no step of its own comes between. (A
graph whose loss is not its last node may leave stages after it; such a loss stage holds
depth + 1 micro-batches like any other and recomputes, or its kept graphs would be stale.)
"""

from __future__ import annotations

from .base import Schedule, StageInfo, StagePolicy, streamed


def policy(st: StageInfo, m: int, gpus: int) -> StagePolicy:
    keeps = st.is_last and st.depth == 0
    return StagePolicy(recompute=not keeps, in_flight=st.depth + 1, weight_delay=None)


SCHEDULE = Schedule("ftpipe", streamed, policy, synchronous=False, doc="FTPipe asynchronous")
