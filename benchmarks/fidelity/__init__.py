"""Section `fidelity` of make bench: measure (bench.py) and report (report.py).

Its children (`python -m benchmarks.fidelity.handmade_plan`, `.stage_times`) profile and time
stages: they take the CPU allocator settings the ranks and `ftpipe compile` run with
(`ftpipe_runtime.prepare_process`: huge pages, the heap kept), set here before torch loads.
Without them the handmade plan's profile was its own (another cache key), taken with every
large tensor mapped afresh: its first stage's backward profiled 92 ms against 66 for the
same nodes in the compiled plans, and ran in 85 with its recompute.
"""

import ftpipe_runtime

ftpipe_runtime.prepare_process()  # a no-op where torch is loaded already (the bench itself)

from .bench import measure  # noqa: E402
from .report import markdown  # noqa: E402

__all__ = ["markdown", "measure"]
