"""The plans a freeze-training run shrinks to (PipeTransformer's AutoPipe + AutoDP, §3.2-3.3).

    shrinks = shrink_plans(graph, plan, alpha=1/3, hardware="cpu")
    # -> (Shrink("d2x2", plan on 2 GPUs x 2 replicas, frozen=1), Shrink("d1x4", ..., 2))

`ftpipe compile --freeze-training ALPHA` writes them beside the main plan
(`<package>/elastic/<name>/`, each with its own stages, and `elastic/index.json`); the
runtime (`ftpipe_runtime.freeze.elastic`) switches to one at a freeze decision.

Each halving of the pipeline is planned for one more decision of alpha's freeze rule at
its fastest (`freezing.bound_schedule`: the bound limits, the most alpha allows): the i-th
shrink runs the pipeline on K / 2^i GPUs with 2^i times the replicas, the frozen prefix of
`bound_schedule(L, alpha, i)[-1]` layers costed forward-only (`frozen_graphs.frozen_graph`: no
gradient, no optimizer state, no activations kept), so the partitioners pack those cheap
layers at the head of the chain, onto the first GPU. Every replica keeps the main plan's
micro-batch size and gets 1 / 2^i of its micro-batches, so a step trains on the same
samples before and after a switch (the same run, only placed otherwise). The schedule is
the main plan's. The plans keep every parameter trainable: which are frozen is the run's
state, and the runtime switches to a shrink only once at least its frozen layers are.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from ftpipe_runtime.freeze.layers import bound_schedule

from ..errors import FtpipeError, InfeasibleError
from ..graph.opgraph import OpGraph
from ..partition import problem_from_graph
from ..plan import Plan
from .frozen_graphs import frozen_graph, graph_units
from .matrix import search_matrix

__all__ = ["Shrink", "shrink_plans", "index_of"]


@dataclass(frozen=True)
class Shrink:
    name: str  # its folder under <package>/elastic/
    plan: Plan
    frozen: int  # layers: the runtime switches to it once at least these are frozen


def shrink_plans(
    graph: OpGraph,
    plan: Plan,
    *,
    alpha: float,
    hardware: str | None = None,
    partitioners: list[str] | None = None,
    steps: int = 20,
    seed: int = 0,
) -> tuple[Shrink, ...]:
    """The pipelines of plan.gpus / 2, / 4 ... GPUs (as long as the micro-batches halve
    too), each the fastest simulated plan under the main plan's schedule."""
    units = graph_units(graph)
    if len(units) < 2:
        raise FtpipeError("--freeze-training needs a model of numbered layers; this has none")
    counts = bound_schedule(len(units), alpha, len(units))
    out, depth, m, i = [], plan.gpus, plan.micro_batches, 0
    while depth % 2 == 0 and m % 2 == 0 and i < len(counts) and counts[i] < len(units):
        depth, m, frozen = depth // 2, m // 2, counts[i]
        i += 1
        g = frozen_graph(graph, frozenset(p for u in units[:frozen] for p in u))
        problem = problem_from_graph(g, depth, hardware, plan.schedule, plan.optimizer, m, seed)
        try:
            best, _ = search_matrix(problem, [plan.schedule], partitioners, steps=steps,
                                progress=False)  # fmt: skip
        except InfeasibleError:
            break
        if best.plan.gpus != depth:  # a GPU with nothing to run: not a shorter pipeline
            break
        replicas = plan.replicas * plan.gpus // depth
        trains = {p.name: p.trainable for p in plan.params}
        shrunk = best.plan.with_(
            # as trainable as in the main plan: which are frozen is the run's state
            params=tuple(replace(p, trainable=trains[p.name]) for p in best.plan.params),
            model=plan.model,
            recompute=plan.recompute,
            replicas=replicas,
            placement=tuple((r, g) for r in range(replicas) for g in range(depth)),
            cluster=None,
            command=plan.command,
        )
        shrunk.validate()
        out.append(Shrink(f"d{depth}x{replicas}", shrunk, frozen))
    return tuple(out)


def index_of(shrinks) -> dict:
    """`elastic/index.json`: what the runtime reads to choose (plain data)."""
    return {
        "plans": [
            {
                "name": s.name,
                "gpus": s.plan.gpus,
                "replicas": s.plan.replicas,
                "micro_batches": s.plan.micro_batches,
                "frozen_layers": s.frozen,
            }
            for s in shrinks
        ]
    }
