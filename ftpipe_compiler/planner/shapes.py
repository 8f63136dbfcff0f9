"""The shapes a cluster allows: replicas x pipeline depth, and where each rank goes.

    depths(cluster)                                  # [8, 16, 32, 64] for 64 GPUs in nodes of 8
    placement(replicas=2, gpus=4, orientation="pipeline")   # ((0, 0), (0, 1), ..., (1, 3))
    orientations(cluster, replicas=8, gpus=8)        # ["pipeline", "replica"]

Ranks fill nodes in order. Two orientations put a replicated pipeline on them:
- `pipeline`: a replica's GPUs on consecutive ranks, so pipeline neighbours share a node
  (fast links carry the activations); a stage's replicas are `gpus` ranks apart.
- `replica`: a stage's replicas on consecutive ranks, so its gradient all-reduce stays in a
  node while neighbours may cross nodes (PipeDream-2BW §3.3: "stage replicas can be placed
  on the same server").
The simulator times replica 0 and takes the others to do the same at the same moments,
which holds when every replica meets node boundaries in the same places: the consecutive
block (a pipeline, or a stage's replicas) divides the node size or is a multiple of it. A
depth or width that does not is left out, a choice made so each candidate is simulated
exactly; one node of any size takes every shape.
"""

from __future__ import annotations

from ftpipe_runtime.errors import unknown_name

from ..costs import cluster as _cluster

ORIENTATIONS = ("pipeline", "replica")


def _fits(block: int, per_node: int, total: int) -> bool:
    """Does a block of consecutive ranks meet node boundaries the same way every time?"""
    return total <= per_node or per_node % block == 0 or block % per_node == 0


def depths(cluster: _cluster.Cluster, replicas: int | None = None) -> list[int]:
    """Pipeline depths p (GPUs per replica) with replicas x p = all GPUs that some
    orientation places evenly; only the depth for `replicas` when it is given."""
    n = cluster.gpus
    out = []
    for p in range(1, n + 1):
        d, rest = divmod(n, p)
        if rest or (replicas is not None and d != replicas):
            continue
        if orientations(cluster, d, p):
            out.append(p)
    return out


def orientations(cluster: _cluster.Cluster, replicas: int, gpus: int) -> list[str]:
    """The orientations that place `replicas` pipelines of `gpus` GPUs evenly."""
    n, g = cluster.gpus, cluster.gpus_per_node
    if replicas == 1 or n <= g:  # one pipeline, or one node: orientation changes nothing
        return ["pipeline"]
    out = [o for o, block in (("pipeline", gpus), ("replica", replicas)) if _fits(block, g, n)]
    return out


def placement(replicas: int, gpus: int, orientation: str) -> tuple[tuple[int, int], ...]:
    """(replica, GPU of the pipeline) of each rank."""
    if orientation == "pipeline":
        return tuple(divmod(rank, gpus) for rank in range(replicas * gpus))
    if orientation == "replica":
        return tuple(divmod(rank, replicas)[::-1] for rank in range(replicas * gpus))
    raise ValueError(unknown_name("orientation", orientation, ORIENTATIONS))


def orientation_of(placed) -> str:
    """The orientation a placement was made with (for reports)."""
    gpus = 1 + max(g for _, g in placed)
    replicas = len(placed) // gpus
    return next(
        (o for o in ORIENTATIONS if placement(replicas, gpus, o) == tuple(placed)), "custom"
    )


def node_span(cluster: _cluster.Cluster, placed, replica: int = 0) -> dict[int, list[int]]:
    """{node: [GPUs of the pipeline there]} for one replica."""
    out: dict[int, list[int]] = {}
    for rank, (r, g) in enumerate(placed):
        if r == replica:
            out.setdefault(cluster.node_of(rank), []).append(g)
    return out
