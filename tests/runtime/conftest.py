"""Fixtures of the runtime tests; the helpers they share live in runtime_helpers.py
(a unique module name: `from conftest import` clashes between test folders)."""

import pytest
from rank_server import shut_down
from runtime_helpers import run_pipeline  # noqa: F401


@pytest.fixture(scope="session", autouse=True)
def _rank_servers():
    """The warm interpreters ranks are forked from (`rank_server`), ended with the session."""
    yield
    shut_down()
