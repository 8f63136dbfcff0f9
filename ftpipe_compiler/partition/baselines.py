"""The baselines every comparison shows, run with the same costs and memory model.

- `even-layers`: contiguous, the same number of transformer layers on every GPU (what GPipe
  and torch.distributed.pipelining users write by hand; called `gpipe` before, renamed so
  that `gpipe` names only the schedule); where the count does not divide,
  the DP picks which GPUs take one more layer.
- `params`: contiguous, balanced by parameter memory (DeepSpeed's default, PipeTransformer).

Both cut as many stages as the schedule's placement asks (one per GPU, or WPipe's two).

A layer is a run of nodes under one numbered module (`encoder.block.3`); nodes outside any
layer (embeddings, final norm, loss) travel with the neighbouring layer.
"""

from __future__ import annotations

import time

import numpy as np

from ..graph.granularity import layer_key
from ..plan import Plan
from .chain import Chain, fitted, runs
from .indexed import NodeCosts, infeasible


def layer_units(costs: NodeCosts) -> list[list[int]]:
    """Layer units; loose runs join the next layer (the last layer takes trailing ones)."""
    out: list[list[int]] = []
    loose: list[int] = []
    nodes = costs.problem.graph.nodes
    for run in runs(costs, layer_key):
        if any(p.isdigit() for p in layer_key(nodes[run[0]].scope).split(".")):
            out.append(loose + run)
            loose = []
        else:
            loose.extend(run)
    if not out:  # no numbered modules: every run is a layer
        return runs(costs, layer_key)
    out[-1].extend(loose)
    return out


def even_layers(problem) -> Plan:
    t0 = time.perf_counter()
    costs = NodeCosts.of(problem)
    chain = Chain(costs, layer_units(costs))
    U = len(chain)
    stages = min(problem.chain_length, U)
    q, r = divmod(U, stages)
    count = np.arange(U)[None, :] - np.arange(U)[:, None] + 1  # layers in segment k..j
    allowed = (count == q) | ((count == q + 1) & (r > 0))
    plan = fitted(
        problem,
        chain,
        "even-layers",
        t0,
        chain.period,
        stages,
        exact=True,
        allowed=allowed,
        per_gpu=problem.per_gpu,
    )
    if plan is None:
        raise infeasible(
            problem,
            "even-layers",
            f"{U} layers split {q}{'-' + str(q + 1) if r else ''} per GPU do not fit",
        )
    return plan


def params(problem) -> Plan:
    t0 = time.perf_counter()
    costs = NodeCosts.of(problem)
    chain = Chain(costs, layer_units(costs))
    static = chain.static.astype(float)
    plan = fitted(
        problem,
        chain,
        "params",
        t0,
        static,
        problem.chain_length,
        exact=True,
        per_gpu=problem.per_gpu,
    )
    if plan is None:
        raise infeasible(problem, "params", "no contiguous split by layers fits")
    return plan
