"""The planner: replicas x pipeline depth, micro-batch, schedule and recompute for a cluster.

    cluster = get_cluster("v100-32gb", gpus=64)
    found = plan_shape(lambda b: graph_traced_with(b), cluster, Space(batch=40))
    found.plan.replicas, found.plan.gpus, found.plan.placed(), found.to_json()

`search` holds the search and the figures it reports, `bounds` what lets it skip shapes,
`shapes` the shapes a cluster allows and where their ranks go.
"""

from .bounds import memory_floor, throughput_bound
from .search import Candidate, Found, Row, Space, best_plan, effective_speedup, plan_shape
from .shapes import ORIENTATIONS, depths, orientation_of, orientations, placement

__all__ = [
    "ORIENTATIONS",
    "Candidate",
    "Found",
    "Row",
    "Space",
    "best_plan",
    "depths",
    "effective_speedup",
    "memory_floor",
    "orientation_of",
    "orientations",
    "placement",
    "plan_shape",
    "throughput_bound",
]
