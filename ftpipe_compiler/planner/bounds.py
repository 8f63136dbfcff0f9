"""Upper bounds on what a shape can reach, so the planner skips shapes that cannot win.

    bound = throughput_bound(problem, replicas=4, cluster=cluster)   # samples/s no plan beats
    step_floor(problem)                                             # seconds no step goes below
    memory_floor(problem)                                           # bytes the fullest GPU needs

Every figure is a bound over all partitions of the shape, so a shape whose bound is below
the best plan found so far cannot beat it:

- compute: a step of m micro-batches keeps some GPU busy m x `Problem.lower_bound()`
  (FTPipe eq. 1's period can be no lower than the work spread evenly, nor than the largest
  indivisible node);
- round trip: under a synchronous schedule (a flush: every GPU's next forward waits for
  the optimizer steps, which wait for every backward) a step holds at least one
  micro-batch's forward along the graph's longest path and its backward back along the
  longest one (the input-gradient part: a split backward defers the rest), whatever the
  cut: a pipeline deeper than its micro-batches are many is mostly fill and drain;
- network: every step each stage sums its gradients with its replicas. Over one node the
  GPUs reduce in parallel, the busiest at least the average's share; across nodes the
  pipeline's node interfaces carry its whole model's ring traffic, the busiest at least
  its share (`Link.allreduce_s`);
- memory: every GPU holds its weights (times the versions the schedule keeps), gradients
  and optimizer state, and without recompute the activations of at least one micro-batch
  per stage in flight; the fullest GPU at least the average.

The two time bounds overlap in the best case (the runtime overlaps them), so a step is at
least the larger of the two.
"""

from __future__ import annotations

from ..costs.cluster import Cluster
from ..partition.problem import Problem
from .shapes import node_span, placement


def gradient_bytes(problem: Problem) -> int:
    """Bytes of all trainable gradients (what the replicas of all stages sum each step):
    the runtime reduces each gradient in its parameter's dtype, one weight's worth."""
    trainable = {p.name for p in problem.graph.params if p.trainable}
    return sum(w for name, (w, _) in problem.param_split.items() if name in trainable)


def round_trip_s(problem: Problem) -> float:
    """Seconds of one micro-batch's forward along the graph's longest path to the loss plus
    its input-gradient backward along the longest path back (transfers and recompute not
    counted: a bound)."""
    g = problem.graph
    fwd: dict[str, float] = {}
    bwd: dict[str, float] = {}
    for n in g.nodes:  # in topological order
        preds = g.preds[n.id]
        fwd[n.id] = n.fwd_s + max((fwd[p] for p in preds), default=0.0)
        bwd[n.id] = n.bwd_s - n.wgrad_s + max((bwd[p] for p in preds), default=0.0)
    return fwd[g.output] + bwd[g.output]


def step_floor(problem: Problem) -> float:
    """Seconds per step no plan of the problem goes below (compute, and under a synchronous
    schedule the round trip)."""
    floor = problem.micro_batches * problem.lower_bound()
    if problem.sched.synchronous:
        floor = max(floor, round_trip_s(problem))
    return floor


def memory_floor(problem: Problem) -> float:
    """Bytes the fullest GPU needs at least, whatever the partition."""
    probes = [problem.policy(problem.chain_stage(k, k == 0, problem.chain_length)) for k in (0, 1)]
    versions = min(p.weight_versions for p in probes)
    trainable = {p.name for p in problem.graph.params if p.trainable}
    held = sum(
        w * (versions if name in trainable else 1) + s
        for name, (w, s) in problem.param_split.items()
    )
    if not problem.recompute:
        in_flight = min(p.in_flight for p in probes)
        held += in_flight * sum(n.act_bytes for n in problem.graph.nodes)
    return held / problem.gpus


def allreduce_floor(problem: Problem, replicas: int, cluster: Cluster, orientation: str) -> float:
    """Seconds per step some link spends summing gradients, at least."""
    if replicas == 1:
        return 0.0
    grads = gradient_bytes(problem)
    placed = placement(replicas, problem.gpus, orientation)
    rank_of = {rg: r for r, rg in enumerate(placed)}
    spans = any(
        len({cluster.node_of(rank_of[(r, g)]) for r in range(replicas)}) > 1
        for g in range(problem.gpus)
    )
    if not spans:  # each GPU reduces with its replicas inside the node, all in parallel
        link = cluster.intra_node
        return link.allreduce_s(grads / problem.gpus, replicas)
    link = cluster.inter_node
    nodes = len(node_span(cluster, placed))
    return link.allreduce_s(grads / nodes, replicas)


def throughput_bound(
    problem: Problem, replicas: int, cluster: Cluster, orientations: list[str]
) -> float:
    """Samples per second no plan of this shape exceeds (0: it cannot fit in memory)."""
    if memory_floor(problem) > problem.memory:
        return 0.0
    m = problem.micro_batches
    compute = step_floor(problem)
    network = min(allreduce_floor(problem, replicas, cluster, o) for o in orientations)
    step = max(compute, network)
    size = int(problem.graph.meta.get("micro_batch", 1))
    return replicas * m * size / step if step > 0 else float("inf")
