"""The runtime's two failures: a bad request (arguments, plan, data) and a lost peer."""

from __future__ import annotations


class PipelineConfigError(ValueError):
    """The plan, the arguments or the data cannot run: one sentence saying what to change."""


class PeerFailure(RuntimeError):
    """Another rank died or stopped answering; the message names the rank waited for."""
