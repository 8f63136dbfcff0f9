"""Simulate a plan under a schedule: throughput, bubbles, memory, and a visual report.

from ftpipe_compiler.simulate import simulate, render_report
result = simulate(plan, "ftpipe", micro_batches=10, steps=10)
html = render_report(plan, result)
"""

from .report import render_report, write_report
from .result import Event, GpuResult, SimResult
from .simulator import simulate

__all__ = ["Event", "GpuResult", "SimResult", "render_report", "simulate", "write_report"]
