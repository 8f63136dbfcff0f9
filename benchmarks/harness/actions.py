"""How long each action of a run really took, to set beside the profile the simulator used.

    rows = load_actions(["run.json.trace.json"])       # the runs' `--trace` files
    per_stage = summarise(rows, micro_batches=4, timed=range(1, 5))

A trace row is (kind, stage, mb, start, end, waited[, cpu, faults[, sys]]): `waited` is the
time the action spent in receives and collectives, so an action's *compute* is its duration
less it, the figure the profile predicts (fwd_s; bwd_s + recompute_s; nothing for a step);
`cpu` the main thread's CPU seconds in it, `faults` its page faults (format 2 traces on) and
`sys` the kernel's part of `cpu` (format 3). A backward that recomputes (kind R in the trace)
counts as a backward here.
"""

from __future__ import annotations

from collections import defaultdict

from ftpipe_runtime.engine.trace import read_trace


def load_actions(paths) -> list:
    """Every rank's rows of the first replica, from the runs' trace files."""
    rows = []
    for p in paths:
        for rank in read_trace(p)["ranks"]:
            if rank.get("replica", 0) == 0:
                rows += [["B" if r[0] == "R" else r[0], *r[1:]] for r in rank["actions"]]
    return rows


def summarise(rows: list, micro_batches: int, timed: range) -> dict:
    """Per stage and kind, over the `timed` steps: mean compute and wait per action, and both
    per step. F and B of micro-batch m belong to step m // micro_batches."""
    acc = defaultdict(lambda: [0, 0.0, 0.0, 0.0, 0, 0.0])
    steps, usage, kernel = set(), True, True
    for kind, stage, mb, start, end, waited, *more in rows:
        step = mb if kind == "S" else mb // micro_batches
        if step not in timed:
            continue
        steps.add(step)
        a = acc[(stage, kind)]
        a[0] += 1
        a[1] += end - start - waited
        a[2] += waited
        usage = usage and len(more) >= 2
        kernel = kernel and len(more) >= 3
        if usage:
            a[3] += more[0]
            a[4] += more[1]
        if kernel:
            a[5] += more[2]
    timed = max(len(steps), 1)
    out: dict = {}
    for (stage, kind), (n, compute, wait, cpu, faults, sys) in sorted(acc.items()):
        out.setdefault(str(stage), {})[kind] = {
            "count": n,
            "compute_s": compute / n,
            "wait_s": wait / n,
            "compute_per_step_s": compute / timed,
            "wait_per_step_s": wait / timed,
            **({"cpu_s": cpu / n, "faults": faults / n} if usage else {}),
            **({"sys_s": sys / n} if kernel else {}),
        }
    return out
