"""The problem as flat lists indexed by a node's position in the graph, for fast searches.

costs = NodeCosts.of(problem); costs.rec[i], costs.preds[i], costs.params[i] ...
topological_stages(costs, stage_of)       # stage ids renumbered along the stage graph
raise infeasible(problem, "mixed")        # "mixed: infeasible: needs 3 GPUs / 29.1 GiB ..."
"""

from __future__ import annotations

import functools
import heapq
from dataclasses import dataclass

from ftpipe_runtime.schedules import StageInfo

from ..errors import FtpipeError, InfeasibleError
from ..units import size
from .problem import Problem


@dataclass
class NodeCosts:
    """The problem's figures as flat lists indexed by a node's position in the graph."""

    problem: Problem
    ids: list[str]
    rec: list[float]  # work per micro-batch when the node's stage recomputes
    last: list[float]  # ... when it sits in the loss stage
    act: list[int]
    out: list[int]
    grad: list[bool]
    preds: list[tuple[int, ...]]
    succs: list[tuple[int, ...]]
    params: list[tuple[int, ...]]
    pstatic: list[int]  # weights (one version) + gradients + optimizer state, by parameter index
    ptrainable: list[int]  # one copy of the weight if trainable (kept per version), else 0
    pfrozen: list[int]  # the weight if frozen (one copy, no gradient), else 0
    pstate: list[int]  # gradient + optimizer state
    pbytes: list[int]  # what its owner sends to other stages reading it
    ptrain: list[bool]  # ... and whether a gradient comes back
    inputs: list[tuple[int, ...]]
    input_bytes: list[int]  # by model-input index
    output: int

    @classmethod
    def of(cls, problem: Problem) -> NodeCosts:
        g = problem.graph
        return cls(
            problem=problem,
            rec=[problem.work_recompute[n.id] for n in g.nodes],
            last=[problem.work_last[n.id] for n in g.nodes],
            pstatic=[sum(problem.gpu_param_split[p.name]) for p in g.params],
            ptrainable=[problem.param_split[p.name][0] if p.trainable else 0 for p in g.params],
            pfrozen=[0 if p.trainable else problem.param_split[p.name][0] for p in g.params],
            pstate=[problem.gpu_param_split[p.name][1] for p in g.params],
            **g.derived("node_costs", _structure),
        )

    @property
    def n(self) -> int:
        return len(self.ids)

    @functools.cached_property
    def loss_keeps(self) -> bool | None:
        """Whether the loss stage keeps its activations (no recompute) wherever it sits, or
        None when the schedule's answer depends on its depth or its GPU's other stages."""
        p = self.problem
        answers = {
            not p.policy(StageInfo(0, 0, depth, True, chunk)).recompute
            for depth in range(self.n + 1)
            for chunk in range(p.per_gpu + 1)
        }
        return answers.pop() if len(answers) == 1 else None

    def chain_policy(self, depth: int, is_last: bool, length: int):
        """The policy of stage `depth` from the end of a chain of `length` stages."""
        return self.problem.policy(self.problem.chain_stage(depth, is_last, length))


def _structure(g) -> dict:
    """The lists of `NodeCosts` that the graph alone makes (edges, parameters and inputs by
    index, sizes): every problem of a search is the same graph under another schedule, and
    these are two thirds of the work. Shared, so never changed."""
    idx = g.index
    pidx = {p.name: k for k, p in enumerate(g.params)}
    iidx = {x.name: k for k, x in enumerate(g.inputs)}
    return dict(
        ids=[n.id for n in g.nodes],
        act=[n.act_bytes for n in g.nodes],
        out=[n.out_bytes for n in g.nodes],
        grad=[n.requires_grad for n in g.nodes],
        preds=[tuple(sorted({idx[p] for p in g.preds[n.id]})) for n in g.nodes],
        succs=[tuple(sorted({idx[s] for s in g.succs[n.id]})) for n in g.nodes],
        params=[tuple(dict.fromkeys(pidx[p] for p in n.params)) for n in g.nodes],
        pbytes=[p.bytes for p in g.params],
        ptrain=[p.trainable for p in g.params],
        inputs=[tuple(dict.fromkeys(iidx[x] for x in n.inputs)) for n in g.nodes],
        input_bytes=[x.bytes for x in g.inputs],
        output=idx[g.output],
    )


def topological_stages(costs: NodeCosts, stage_of: list[int]) -> list[int]:
    """Renumber stages 0..S-1 so every edge goes from a lower or equal stage to a higher one.

    Ties go to the stage whose first node comes first, as `build_plan` numbers them.
    """
    first: dict[int, int] = {}
    for i, s in enumerate(stage_of):
        first.setdefault(s, i)
    succ: dict[int, set[int]] = {s: set() for s in first}
    for i, s in enumerate(stage_of):
        for j in costs.succs[i]:
            if stage_of[j] != s:
                succ[s].add(stage_of[j])
    order = lowest_first(succ, first.__getitem__)
    if order is None:
        raise FtpipeError("internal error: a partitioner produced a cyclic stage graph")
    renum = {s: k for k, s in enumerate(order)}
    return [renum[s] for s in stage_of]


def lowest_first(succ: dict, key=None) -> list | None:
    """The nodes of `succ` (node -> its successors) in topological order, the lowest `key`
    (default: the node itself) first among those ready, so an order already topological by
    that key is kept (Kahn's algorithm); None when the graph has a cycle."""
    key = key or (lambda x: x)
    indeg = dict.fromkeys(succ, 0)
    for bs in succ.values():
        for b in bs:
            indeg[b] += 1
    ready = [(key(x), x) for x, k in indeg.items() if not k]
    heapq.heapify(ready)
    order = []
    while ready:
        _, x = heapq.heappop(ready)
        order.append(x)
        for b in succ[x]:
            indeg[b] -= 1
            if not indeg[b]:
                heapq.heappush(ready, (key(b), b))
    return order if len(order) == len(succ) else None


def infeasible(problem: Problem, partitioner: str, why: str = "") -> InfeasibleError:
    """'infeasible: needs 3 GPUs / 29.1 GiB' when the weights alone need more GPUs; when they
    would fit, activations or indivisible layers are what is missing: 'needs more than P'."""
    total = sum(sum(split) for split in problem.gpu_param_split.values())  # on the GPUs
    need = max(1, -(-total // problem.memory)) if problem.memory > 0 else problem.gpus + 1
    have = f"have {problem.gpus} x {problem.memory_said()}"
    tail = f" ({why})" if why else ""
    if need > problem.gpus:
        return InfeasibleError(
            f"{partitioner}: infeasible: needs {need} GPUs / {size(total)} of weights, "
            f"gradients and optimizer state; {have}{tail}"
        )
    return InfeasibleError(
        f"{partitioner}: infeasible: needs more than {problem.gpus} GPUs / {size(total)}: the "
        f"weights, gradients and optimizer state fit in {need}, but not with the activations and "
        f"layer sizes; {have}{tail}"
    )
