"""The planner: replicas x pipeline depth, micro-batch, schedule and recompute for a cluster.

    cluster = get_cluster("v100-32gb", gpus=64)
    found = plan_shape(lambda b: graph_traced_with(b), cluster, Space(batch=40))
    found.plan.replicas, found.plan.gpus, found.plan.placed(), found.to_json()

`search` holds the search and the figures it reports, `bounds` what lets it skip shapes,
`shapes` the shapes a cluster allows and where their ranks go; `matrix` chooses the partition
and the schedule together for one pipeline (`search_matrix`, what `ftpipe compile` runs
without a cluster); `elastic` and `shrink` the plans of a freezing run.
"""

from .bounds import memory_floor, throughput_bound
from .matrix import GROUPS, Cell, schedule_names, search_matrix
from .search import (
    Candidate,
    Found,
    Row,
    Space,
    best_for_candidate,
    effective_speedup,
    plan_shape,
)
from .shapes import ORIENTATIONS, depths, orientation_of, orientations, placement

__all__ = [
    "GROUPS",
    "ORIENTATIONS",
    "Cell",
    "Candidate",
    "Found",
    "Row",
    "Space",
    "best_for_candidate",
    "depths",
    "effective_speedup",
    "memory_floor",
    "orientation_of",
    "orientations",
    "placement",
    "plan_shape",
    "schedule_names",
    "search_matrix",
    "throughput_bound",
]
