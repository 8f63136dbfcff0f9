"""Fixtures of the runtime tests; the helpers they share live in runtime_helpers.py
(a unique module name: `from conftest import` clashes between test folders)."""

from runtime_helpers import run_pipeline  # noqa: F401
