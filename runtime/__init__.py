"""ftpipe's pipeline runtime: schedules and the torch.distributed executor.

Generated packages import this and torch, never the compiler.
"""

from .errors import PeerFailure, PipelineConfigError, ScheduleError
from .run import run
from .schedules import (
    SCHEDULES,
    Action,
    Schedule,
    StageInfo,
    StagePolicy,
    actions,
    get_schedule,
    interleave,
    resolve_schedule,
    validate,
)

__all__ = [
    "PeerFailure",
    "PipelineConfigError",
    "ScheduleError",
    "run",
    "SCHEDULES",
    "Action",
    "Schedule",
    "StageInfo",
    "StagePolicy",
    "actions",
    "get_schedule",
    "interleave",
    "resolve_schedule",
    "validate",
]
