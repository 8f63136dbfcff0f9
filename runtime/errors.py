"""The runtime's failures: a bad request (arguments, plan, data, schedule), a lost peer, a failed
write."""

from __future__ import annotations


class PipelineConfigError(ValueError):
    """The plan, the arguments or the data cannot run: one sentence saying what to change."""


class ScheduleError(PipelineConfigError):
    """A schedule that cannot run on this plan; the message names the offending action."""


class PeerFailure(RuntimeError):
    """Another rank died or stopped answering; the message names the rank waited for."""


class WriteFailed(OSError):
    """A file could not be written (full disk, no permission); the previous one is intact."""


def pick(table: dict, name: str, kind: str, error: type = PipelineConfigError, more: str = ""):
    """`table[name]`, or the registries' one unknown-name error: "unknown schedule 'x';
    choose from gpipe, 1f1b, ..." (the choices in the table's order, then `more`)."""
    try:
        return table[name]
    except KeyError:
        raise error(f"unknown {kind} {name!r}; choose from {', '.join(table)}{more}") from None
