"""One exception hierarchy; the CLI catches `FtpipeError` once and prints its message."""

from ftpipe_runtime.errors import PipelineConfigError, unknown_name


class FtpipeError(Exception):
    """Bad input or an impossible request: the message says what is wrong and what to do."""


class UnknownNameError(FtpipeError, ValueError):
    """An unknown model, hardware, task, partitioner or schedule name."""


class TraceError(FtpipeError):
    """The model could not be exported into an operator graph."""


class InfeasibleError(FtpipeError):
    """No plan fits the GPUs' memory."""


class PlanFormatError(FtpipeError, PipelineConfigError):
    """A plan or graph file is missing, truncated, or written by another version (for a
    plan: the runtime's reader's PipelineConfigError, in the same words)."""


class OutputExistsError(FtpipeError):
    """The output folder exists and --force was not given."""


def unknown(kind: str, name: str, choices) -> UnknownNameError:
    """`unknown("partitioner", "foo", PARTITIONERS)` -> the standard unknown-name error."""
    return UnknownNameError(unknown_name(kind, name, sorted(choices)))
