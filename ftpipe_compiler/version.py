# One home: the runtime reads plans.
from ftpipe_runtime.spec.format import PLAN_FORMAT, READABLE_FORMATS  # noqa: F401

__version__ = "0.1.0"
# Bumped whenever graph.json changes shape; readers refuse other formats.
GRAPH_FORMAT = 1
