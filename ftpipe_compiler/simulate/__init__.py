"""Simulate a plan under a schedule: throughput, bubbles, memory, and a visual report.

from ftpipe_compiler.simulate import simulate, render_report
result = simulate(plan, "ftpipe", micro_batches=10, steps=10)
html = render_report(plan, result)
rows = compare([("a", plan, "gpipe"), ("a", plan, "2bw")]); print(table(rows))
"""

from .compare import Row, compare, table
from .report import render_report, write_report
from .result import Event, GpuResult, SimResult
from .simulator import simulate, steady_steps

__all__ = [
    "Event",
    "GpuResult",
    "Row",
    "SimResult",
    "compare",
    "render_report",
    "simulate",
    "steady_steps",
    "table",
    "write_report",
]
