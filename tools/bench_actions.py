"""How long each action of a run really took, to set beside the profile the simulator used.

    rows = record_actions()          # in a rank, before ftpipe_runtime.run(...)
    save_actions(rows, "run.rank0.actions.json")
    per_stage = summarise(load_actions(paths), micro_batches=4, timed=range(1, 5))

Wraps the executor's forward / backward / step and the waits inside them (receives, the
all-reduces of a step): an action's *compute* is its duration less those waits, the figure
the profile predicts (fwd_s; bwd_s + recompute_s; nothing for a step). These are runtime
internals: if they change shape, `record_actions` returns None and the run goes on untimed.
"""

from __future__ import annotations

import json
import time
from collections import defaultdict

from ftpipe_runtime.atomic import write_atomic


def record_actions() -> list | None:
    """Start recording (kind, stage, mb, start, end, waited) rows; None if not possible."""
    from ftpipe_runtime import comm, executor

    cls, link = executor.Executor, comm.Comm
    methods = {"F": "forward", "B": "backward", "S": "step"}
    if not all(hasattr(cls, m) for m in methods.values()) or not hasattr(link, "recv"):
        return None
    rows: list = []
    waited = [0.0]

    def waiting(fn):
        def wrapper(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                waited[0] += time.perf_counter() - t0

        return wrapper

    def timed(kind, fn):
        def wrapper(self, i, a):
            waited[0] = 0.0
            t0 = time.perf_counter()
            fn(self, i, a)
            rows.append((kind, a.stage, a.mb, t0, time.perf_counter(), waited[0]))

        return wrapper

    for name in ("recv", "all_reduce"):
        if hasattr(link, name):
            setattr(link, name, waiting(getattr(link, name)))
    for kind, name in methods.items():
        setattr(cls, name, timed(kind, getattr(cls, name)))
    return rows


def save_actions(rows: list, path) -> None:
    write_atomic(path, json.dumps(rows))


def load_actions(paths) -> list:
    rows = []
    for p in paths:
        with open(p) as f:
            rows += json.load(f)
    return rows


def summarise(rows: list, micro_batches: int, timed: range) -> dict:
    """Per stage and kind, over the `timed` steps: mean compute and wait per action, and both
    per step. F and B of micro-batch m belong to step m // micro_batches."""
    acc = defaultdict(lambda: [0, 0.0, 0.0])
    steps = set()
    for kind, stage, mb, start, end, waited in rows:
        step = mb if kind == "S" else mb // micro_batches
        if step not in timed:
            continue
        steps.add(step)
        a = acc[(stage, kind)]
        a[0] += 1
        a[1] += end - start - waited
        a[2] += waited
    timed = max(len(steps), 1)
    out: dict = {}
    for (stage, kind), (n, compute, wait) in sorted(acc.items()):
        out.setdefault(str(stage), {})[kind] = {
            "count": n,
            "compute_s": compute / n,
            "wait_s": wait / n,
            "compute_per_step_s": compute / timed,
            "wait_per_step_s": wait / timed,
        }
    return out
