"""ftpipe's pipeline runtime: schedules and the torch.distributed executor.

Generated packages import this and torch, never the compiler.
"""

from .errors import PeerFailure, PipelineConfigError
from .run import run
from .schedules import (
    SCHEDULES,
    Action,
    Schedule,
    StageInfo,
    actions,
    get_schedule,
    interleave,
)

__all__ = [
    "PeerFailure",
    "PipelineConfigError",
    "run",
    "SCHEDULES",
    "Action",
    "Schedule",
    "StageInfo",
    "actions",
    "get_schedule",
    "interleave",
]
