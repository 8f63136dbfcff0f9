"""ftpipe's pipeline runtime: schedules and the torch.distributed executor.

Generated packages import this and torch, never the compiler.
"""

from .schedules import SCHEDULES, Action, Schedule, get_schedule

__all__ = ["SCHEDULES", "Action", "Schedule", "get_schedule"]
