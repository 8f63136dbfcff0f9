"""The runtime's failures: a bad request (arguments, plan, data, schedule), a lost peer, a failed
write."""

from __future__ import annotations


class PipelineConfigError(ValueError):
    """The plan, the arguments or the data cannot run: one sentence saying what to change."""


class ScheduleError(PipelineConfigError):
    """A schedule that cannot run on this plan; the message names the offending action."""


class PeerFailure(RuntimeError):
    """Another rank died, stopped or hung; the message names it and what this rank waited
    for. `code`: the exit code that follows (130 when the run was interrupted by Ctrl-C)."""

    def __init__(self, message: str, code: int = 1):
        super().__init__(message)
        self.code = code


class WriteFailed(OSError):
    """A file could not be written (full disk, no permission); the previous one is intact."""


def unknown_name(kind: str, name, choices, more: str = "") -> str:
    """The one sentence for a name no registry holds, on both sides (the compiler's `unknown`,
    `pick` here, click's option checks): "unknown schedule 'x'; choose from gpipe, 1f1b, ..."
    (the choices in the order given, then `more`)."""
    return f"unknown {kind} {name!r}; choose from {', '.join(choices)}{more}"


def pick(table: dict, name: str, kind: str, error: type = PipelineConfigError, more: str = ""):
    """`table[name]`, or the registries' one unknown-name error (`unknown_name`)."""
    try:
        return table[name]
    except KeyError:
        raise error(unknown_name(kind, name, table, more)) from None
