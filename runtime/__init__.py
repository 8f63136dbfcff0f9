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
- here: `prepare_process()` (the process settings a package applies before torch loads),
  `errors` (the runtime's failures), `atomic` (every file written whole or not at all).
"""

import importlib

# Importing the runtime loads nothing and changes nothing (no torch, no process settings): a
# name is imported when first used, and a package's entry point calls `prepare_process()`.
_HOMES = {
    **dict.fromkeys(("PeerFailure", "PipelineConfigError", "ScheduleError"), ".errors"),
    "prepare_process": ".job.cpu_allocator",
    "run": ".job.train",
    "main": ".job.cli",  # a generated package's entry: main(argv, stages, plan_path, package)
    **dict.fromkeys(("STAGE_API", "Param", "StageModule"), ".stage.api"),
    **dict.fromkeys(
        ("SCHEDULES", "Action", "Schedule", "StageInfo", "StagePolicy", "actions",
         "get_schedule", "interleave", "resolve_schedule", "validate"),
        ".schedules",
    ),
}  # fmt: skip
__all__ = list(_HOMES)  # every public name, each loaded from its home


def __getattr__(name: str):
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from .job.signals import starting

    with starting():  # a command's Ctrl-C while torch loads: one line, not an import's traceback
        value = getattr(importlib.import_module(home, __name__), name)
    globals()[name] = value
    return value
