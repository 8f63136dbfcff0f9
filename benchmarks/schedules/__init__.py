"""Section `schedules` of make bench: measure (bench.py) and report (report.py)."""

from .bench import measure
from .report import markdown

__all__ = ["markdown", "measure"]
