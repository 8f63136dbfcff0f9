"""The plan file's format number: what the compiler writes and what a package reads. Its own
module, without torch, so that `ftpipe --version` and `ftpipe --help` load nothing heavy."""

__all__ = ["PLAN_FORMAT", "READABLE_FORMATS"]

# Bumped whenever plan.json changes shape; the compiler and the runtime refuse other formats.
# Format 2 added data parallelism (replicas, placement, cluster); a format-1 plan is one
# pipeline, read as such.
PLAN_FORMAT = 2
READABLE_FORMATS = (1, 2)
