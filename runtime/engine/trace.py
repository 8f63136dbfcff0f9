"""When each action of a run started and ended, per rank: the hook around every action.

    tracer = Tracer(comm)                 # the executor calls tracer.action(a) around each
    with tracer.action(a): ...            # a torch.profiler range "ftpipe 0F3"; a row with --trace
    write_trace("trace.json", [rows of rank 0, rows of rank 1, ...], meta)   # rank 0, at the end
    trace = read_trace("trace.json")      # what `ftpipe simulate plan.json --compare` reads

Every action runs inside `torch.profiler.record_function("ftpipe <action>")`, so a
`torch.profiler` trace of a run shows the schedule. With `--trace FILE`, each rank also keeps
one row per action: [kind, stage, mb, start, end, waited, cpu, faults, sys], seconds from when
the ranks started together (a barrier), kind "R" for a backward that recomputes, `waited` the
seconds of it spent waiting for messages or collectives (`Comm.waited`), `cpu` the CPU
seconds of the rank's main thread in it (user and system: a compute-bound action spends its
duration, one slowed by page faults or by another thread on its core shows it) and `faults`
its page faults (each of a fresh CPU tensor's 4 KB pages costs one without huge pages:
`cpu_allocator`), `sys` the part of `cpu` spent in the kernel (a profile taken in a tight
loop rarely sees the kernel's share grow; a run can: on a VM whose host takes freed memory
back, touching it again costs several times more); and what it sent to other ranks per
message kind ("act", "grad", "weight", "wgrad", "eval": [messages, bytes]; the replicas'
collectives as a ring sends them: "grad all-reduce", "grad reduce-scatter", "weights
all-gather", "optimizer state all-gather"). Format 1 rows
have the first six only, format 2 the first eight.
Rank 0 gathers the rows and writes them, atomically, with the run's schedule and
micro-batches.
"""

from __future__ import annotations

import contextlib
import json
import resource
import time

import torch

from ..atomic import write_atomic
from ..errors import PipelineConfigError
from ..spec.topology import read_json

__all__ = ["TRACE_KIND", "Tracer", "read_trace", "write_trace"]

TRACE_KIND = "ftpipe-trace"
# This thread's usage where Linux tells it apart from the process's (gloo's threads copy
# messages meanwhile); elsewhere the process's.
_WHO = getattr(resource, "RUSAGE_THREAD", resource.RUSAGE_SELF)


def _usage() -> tuple[int, float]:
    """(page faults, kernel CPU seconds) of this thread so far."""
    r = resource.getrusage(_WHO)
    return r.ru_minflt, r.ru_stime


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
            (faults, sys), cpu = _usage(), time.thread_time()
            start = time.perf_counter()
            yield
            end = time.perf_counter()
            cpu = time.thread_time() - cpu
            faults, sys = (now - before for now, before in zip(_usage(), (faults, sys)))
            kind = "R" if a.recompute else a.kind
            spent = getattr(self.comm, "waited", 0.0) - waited
            self.rows.append(
                [kind, a.stage, a.mb, start - self.t0, end - self.t0, spent, cpu, faults, sys]
            )


def write_trace(path, ranks: list[dict], meta: dict) -> None:
    """ranks: [{"rank", "gpu", "replica", "actions": rows}], one per process."""
    write_atomic(path, json.dumps({"kind": TRACE_KIND, "format": 3, **meta, "ranks": ranks}))


def read_trace(path) -> dict:
    d = read_json(path, "the trace", "run the package again with --trace")
    if not isinstance(d, dict) or d.get("kind") != TRACE_KIND or "ranks" not in d:
        raise PipelineConfigError(
            f"{path} is not an ftpipe trace; write one with the package's --trace FILE"
        )
    return d
