"""From a `--model` spec to a costed graph: the first half of `profile` and `compile`.

traced, graph = costed_graph("t5-3b", task="rte", hardware="rtx2080ti")
"""

from __future__ import annotations

from .costs import analytic_costs
from .errors import FtpipeError
from .graph import OpGraph
from .hardware import get_hardware
from .trace import Traced, trace_model
from .zoo import ModelSpec, Task, resolve_model, resolve_task

GRANULARITIES = ("op", "layer")
PROFILERS = ("analytic", "measured")


def costed_graph(
    model: str,
    task: str | None = None,
    hardware: str = "rtx2080ti",
    micro_batch: int | None = None,
    seq_len: int | None = None,
    granularity: str = "op",
    profile: str = "analytic",
    **measured_options,
) -> tuple[ModelSpec, Task, Traced, OpGraph]:
    if granularity not in GRANULARITIES:
        raise FtpipeError(
            f"unknown granularity {granularity!r}; choose from {', '.join(GRANULARITIES)}"
        )
    if profile not in PROFILERS:
        raise FtpipeError(f"unknown profiler {profile!r}; choose from {', '.join(PROFILERS)}")
    hw = get_hardware(hardware)
    spec = resolve_model(model)
    t = resolve_task(spec, task, seq_len)
    mb = micro_batch or t.micro_batch
    if mb < 1:
        raise FtpipeError(f"--micro-batch must be at least 1, not {mb}")
    traced = trace_model(spec, t, mb)
    if profile == "measured":
        from .measured import measured_costs

        graph = measured_costs(traced, spec, granularity=granularity, **measured_options)
    else:
        graph = analytic_costs(traced, hw, granularity)
    return spec, t, traced, graph
