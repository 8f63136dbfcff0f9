from ftpipe_runtime.topology import PLAN_FORMAT  # noqa: F401 - one home: the runtime reads plans

__version__ = "0.1.0"
# Bumped whenever graph.json changes shape; readers refuse other formats.
GRAPH_FORMAT = 1
