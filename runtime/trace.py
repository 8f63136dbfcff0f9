"""When each action of a run started and ended, per rank: the hook around every action.

    tracer = Tracer(comm)                 # the executor calls tracer.action(a) around each
    with tracer.action(a): ...            # a torch.profiler range "ftpipe 0F3"; a row with --trace
    write_trace("trace.json", [rows of rank 0, rows of rank 1, ...], meta)   # rank 0, at the end
    trace = read_trace("trace.json")      # what `ftpipe simulate plan.json --compare` reads

Every action runs inside `torch.profiler.record_function("ftpipe <action>")`, so a
`torch.profiler` trace of a run shows the schedule. With `--trace FILE`, each rank also keeps
one row per action: [kind, stage, mb, start, end, waited], seconds from when the ranks
started together (a barrier), kind "R" for a backward that recomputes, and `waited` the
seconds of it spent waiting for messages or collectives (`Comm.waited`), and what it sent to
other ranks per message kind ("act", "grad", "weight", "wgrad", "eval": [messages, bytes]).
Rank 0 gathers the rows and writes them, atomically, with the run's schedule and
micro-batches.
"""

from __future__ import annotations

import contextlib
import json
import time

import torch

from .atomic import write_atomic
from .errors import PipelineConfigError
from .topology import read_json

__all__ = ["TRACE_KIND", "Tracer", "read_trace", "write_trace"]

TRACE_KIND = "ftpipe-trace"


class Tracer:
    def __init__(self, comm=None, keep: bool = False):
        self.comm, self.keep = comm, keep
        self.rows: list[list] = []
        self.t0 = time.perf_counter()

    def start(self) -> None:
        """The ranks start together now: times count from here."""
        self.t0 = time.perf_counter()

    @contextlib.contextmanager
    def action(self, a):
        with torch.profiler.record_function(f"ftpipe {a}"):
            if not self.keep:
                yield
                return
            waited = getattr(self.comm, "waited", 0.0)
            start = time.perf_counter()
            yield
            end = time.perf_counter()
            kind = "R" if a.recompute else a.kind
            spent = getattr(self.comm, "waited", 0.0) - waited
            self.rows.append([kind, a.stage, a.mb, start - self.t0, end - self.t0, spent])


def write_trace(path, ranks: list[dict], meta: dict) -> None:
    """ranks: [{"rank", "gpu", "replica", "actions": rows}], one per process."""
    write_atomic(path, json.dumps({"kind": TRACE_KIND, "format": 1, **meta, "ranks": ranks}))


def read_trace(path) -> dict:
    d = read_json(path, "the trace", "run the package again with --trace")
    if not isinstance(d, dict) or d.get("kind") != TRACE_KIND or "ranks" not in d:
        raise PipelineConfigError(
            f"{path} is not an ftpipe trace; write one with the package's --trace FILE"
        )
    return d
