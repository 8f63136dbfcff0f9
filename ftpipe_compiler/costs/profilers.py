"""From a `--model` spec to a costed graph: the first half of `profile` and `compile`.

traced, graph = costed_graph("t5-3b", task="rte", hardware="rtx2080ti")
"""

from __future__ import annotations

import contextlib
import gc
from dataclasses import replace

from ftpipe_runtime.errors import unknown_name
from ftpipe_runtime.train.precision import PRECISIONS

from ..errors import FtpipeError
from ..graph.opgraph import OpGraph
from ..graph.trace import Traced, trace_model
from ..model.frozen import parse_lora
from ..model.tasks import Task, resolve_task
from ..model.zoo import ModelSpec, resolve_model
from .analytic import analytic_costs
from .hardware import get_hardware
from .measured import measured_costs

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
    *,
    head: str | None = None,
    target_len: int | None = None,
    batch: int | None = None,
    precision: str = "fp32",
    freeze: str | None = None,
    lora: str | None = None,
    fuse_loss: bool = True,
    pack: bool = False,
    **measured_options,
) -> tuple[ModelSpec, Task, Traced, OpGraph]:
    if granularity not in GRANULARITIES:
        raise FtpipeError(unknown_name("granularity", granularity, GRANULARITIES))
    if profile not in PROFILERS:
        raise FtpipeError(unknown_name("profiler", profile, PROFILERS))
    hw = get_hardware(hardware)
    with _collector_paused():
        spec = resolve_model(model, head)
        if freeze or lora:  # applied when the model is built (frozen.adapted)
            spec = replace(spec, freeze=freeze or "", lora=parse_lora(lora))
        if pack:  # packed documents kept apart: traced with position ids (ModelSpec.for_packing)
            spec = spec.for_packing()
        t = resolve_task(spec, task, seq_len, target_len, micro_batch, batch)
        if precision not in PRECISIONS:
            raise FtpipeError(unknown_name("precision", precision, PRECISIONS))
        traced = trace_model(spec, t, t.micro_batch, precision=precision, fuse_loss=fuse_loss)
        if profile != "measured":
            graph = analytic_costs(traced, hw, granularity)
    if profile == "measured":  # runs the model: its garbage collected as usual
        graph = measured_costs(traced, spec, granularity=granularity, **measured_options)
    return spec, t, traced, graph


@contextlib.contextmanager
def _collector_paused():
    """Tracing (the model's imports, torch.export) allocates millions of objects and keeps
    nearly all: the collector's passes over them, finding little, took a second of T5-3B's
    few (a few MB more stay until it runs again)."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()
