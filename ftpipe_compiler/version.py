__version__ = "0.1.0"
# Bumped whenever plan.json or graph.json change shape; readers refuse other formats.
PLAN_FORMAT = 1
GRAPH_FORMAT = 1
