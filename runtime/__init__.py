"""ftpipe's pipeline runtime: schedules and the torch.distributed executor.

Generated packages import this and torch, never the compiler. The modules, in the order a
run meets them:

- entry: `cli` (a package's command line), `options` (its arguments), `run` (the run in
  phases), `ranks` (where this rank runs, how the ranks meet), `mode` (freeze training and
  the shorter plans it switches to: `freezing`, `elastic`).
- the plan and the stages: `topology`, `stage_api` (what generated stages build on),
  `weights` (initial values, checkpoint keys, the traced wrapper's prefix), `stages`,
  `frozen`, `precision`, `models/` (heads, synthetic inputs, HuggingFace, LoRA),
  `fused_loss` (the LM head and its cross-entropy as one op, `torch.ops.ftpipe`, registered
  on import: generated stages call it).
- data: `finetune` (opens --data / --eval-data), `data`, `token_files`, `text_data`,
  `replicas` (each replica's share, gradient sums).
- executing: `schedules/` (schedules as data), `dataflow`, `comm`, `outputs`, `executor`,
  `split_backward`, `stepping`, `optim`, `evaluate`, `assemble` (wiring them), `trace`.
- state and output: `prepare`, `checkpoint`, `checkpoint_files`, `saver`, `export`,
  `report`, `runlog`, `summary`, `atomic`, `check` (a package's --check), `errors`.
- before all of them: `cpu_allocator` (huge pages for large CPU tensors, set before torch
  loads, and glibc's heap kept between micro-batches: importing this package first is what
  turns them on) and `signals` (a command's Ctrl-C or SIGTERM while torch loads, and SIGTERM
  after: one line, exit codes 130 / 143).
"""

from .cpu_allocator import keep_heap, use_huge_pages
from .signals import starting

use_huge_pages()  # before any module below imports torch
keep_heap()

with starting():  # a command's Ctrl-C while torch loads: one line, not an import's traceback
    from . import fused_loss  # noqa: F401 - registers torch.ops.ftpipe for generated stages
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
