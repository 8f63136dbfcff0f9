"""PipeDream's dynamic program (Narayanan et al., SOSP'19) over a topological chain.

The op graph's order is compressed into a chain of units of about equal work (PipeDream
itself works on a chain of profiled layers; finer units let it balance as well as a chain
can), then the DP picks contiguous stages, one per GPU, minimising the slowest stage:

    A(k, d) = min over j of max(S(k..j at depth d), A(j + 1, d - 1))

run from the end of the chain so each stage's depth (and so its in-flight micro-batches)
is known exactly. Unlike the public implementation it counts boundary transfers (FTPipe
eq. 1), the loss stage that does not recompute, and memory. A schedule that fixes its
placement (WPipe: 2 stages per GPU in a loop) gets a chain of exactly that many stages,
placed by the pattern.

    plan = pipedream(problem)
"""

from __future__ import annotations

import time

from ..plan import Plan
from .chain import Chain, compress, fitted
from .indexed import NodeCosts, infeasible

MAX_UNITS = 384  # chain length: ~0.3% of the work per unit on T5-3B, a second of DP


def pipedream(problem, max_units: int = MAX_UNITS) -> Plan:
    t0 = time.perf_counter()
    costs = NodeCosts.of(problem)
    units = compress(costs, [[i] for i in range(costs.n)], max_units)
    chain = Chain(costs, units)
    n = problem.chain_length  # a schedule with a pattern (WPipe's loop) gets exactly its stages
    plan = fitted(
        problem,
        chain,
        "pipedream",
        t0,
        chain.period,
        n,
        exact=problem.patterned,
        per_gpu=problem.per_gpu,
    )
    if plan is None:
        raise infeasible(problem, "pipedream", "no contiguous split fits")
    return plan
