"""ftpipe's pipeline runtime: schedules and the torch.distributed executor.

Generated packages import this and torch, never the compiler. Its folders, in the order a
run meets them (docs/architecture.md maps every module):

- `job/`: one torchrun job on this rank: command line, ranks, liveness, signals, the run's
  phases, reports, `--check`, process settings.
- `spec/`: the plan as data and the weights' names: the contract shared with the compiler.
- `stage/`: what generated stages build on, and the fused LM-head loss they call.
- `models/`: model families from their HuggingFace head (inputs, labels, synthetic batches).
- `data/`: training and evaluation data.
- `schedules/`: schedules as data (per-GPU action lists).
- `engine/`: executing the action lists: messages, actions, evaluation, traces.
- `train/`: the update rule: optimizers, mixed precision, data parallelism.
- `checkpoint/`: checkpoints and HuggingFace folders.
- `freeze/`: freeze training and the switch to shorter plans.
- here: `errors` (the runtime's failures), `atomic` (every file written whole or not at all).
"""

from .job.cpu_allocator import keep_heap, use_huge_pages
from .job.signals import starting

use_huge_pages()  # before any module below imports torch
keep_heap()

with starting():  # a command's Ctrl-C while torch loads: one line, not an import's traceback
    from .errors import PeerFailure, PipelineConfigError, ScheduleError
    from .job.train import run
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
    from .stage import fused_loss  # noqa: F401 - registers torch.ops.ftpipe for generated stages

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
