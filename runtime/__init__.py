"""ftpipe's pipeline runtime: schedules and the torch.distributed executor.

Generated packages import this and torch, never the compiler. The modules, in the order a
run meets them:

- entry: `cli` (a package's command line), `options` (its arguments), `run` (the run in
  phases), `ranks` (where this rank runs, how the ranks meet), `device` (its GPU, CPU
  threads and TF32), `mode` (freeze training and
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
  turns them on).
"""

from .cpu_allocator import keep_heap, use_huge_pages

use_huge_pages()  # before any module below imports torch
keep_heap()

from . import fused_loss  # noqa: E402, F401 - registers torch.ops.ftpipe for generated stages
from .errors import PeerFailure, PipelineConfigError, ScheduleError  # noqa: E402
from .run import run  # noqa: E402
from .schedules import (  # noqa: E402
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
