"""Is a plan one that can run? `Plan.validate` asks here: first the runtime's structural
checks, the same every reader of a plan file applies (`ftpipe_runtime.spec.plan.check_plan`:
sizes, stages, transfers, schedule, placement), then what only the cost model can say,
whether every GPU and every node's host holds what the plan puts there. Each check raises
FtpipeError naming the first thing wrong.

Kept apart from the dataclasses in plan.py: those say what a plan is, this says what a
runnable one must satisfy.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ftpipe_runtime.errors import PipelineConfigError
from ftpipe_runtime.spec.plan import check_plan as check_structure

from ..costs.host import host_memory
from ..errors import FtpipeError

if TYPE_CHECKING:  # plan.py imports this module; the type is only for reading
    from .plan import Plan

__all__ = ["check_plan"]


def check_plan(plan: Plan, *, memory: bool = True) -> None:
    try:
        check_structure(plan, runnable=False)  # a plan being cut may leave GPUs idle
    except PipelineConfigError as e:
        raise FtpipeError(str(e)) from None
    if memory:
        _check_memory(plan)


def _check_memory(plan: Plan) -> None:
    over = [g for g in range(plan.gpus) if plan.gpu_memory(g) > plan.memory_bytes]
    if over:
        raise FtpipeError(
            f"GPU {over[0]} needs {plan.gpu_memory(over[0]) / 2**30:.1f} GiB, more than its "
            f"{plan.memory_bytes / 2**30:.1f} GiB"
        )
    if not plan.host_fits:
        node, held = max(host_memory(plan).items(), key=lambda kv: kv[1])
        raise FtpipeError(
            f"node {node}'s host needs {held / 2**30:.1f} GiB for what its stages offload, more "
            f"than its {plan.host.memory_bytes / 2**30:.1f} GiB"
        )
