"""Section `offload` of make bench (bench.py: measure and markdown)."""

from .bench import markdown, measure

__all__ = ["markdown", "measure"]
