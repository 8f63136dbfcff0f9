"""Section `startup` of BENCHMARKS.md: how long a package takes to reach its first step, for
--steps 10 and --steps 100000.

    python -m benchmarks --sections startup --out /tmp/startup.md

The runtime makes each rank's actions a step window at a time (`schedules.Timeline`), so
neither the time to start nor the memory before step 1 should grow with --steps (they did:
the whole run's lists were built up front, 23 s and 763 MiB for 50,000 steps). For every
schedule, the gpt2-tiny package on 2 CPU ranks is launched with each step count and timed
from launch to rank 0's log line of step 1 (set-up plus one step, the same step either way),
then stopped; the CPU time and peak resident memory of each rank at that moment are read
from /proc. The runs alternate between the two step counts for ROUNDS rounds, so that a
disturbance from outside (the machine is shared) spoils neither side in particular.
Target (issue 14): 100,000 steps reach step 1 less than 2 s after 10 steps do.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import threading
import time
from functools import partial
from pathlib import Path

from benchmarks.harness.launch import ROOT, child_env, compile_plan
from benchmarks.harness.set_up import prepare, take, timed_only
from benchmarks.harness.stats import OtherLoad

WORK = ROOT / "out" / "bench" / "startup"

MODEL, GPUS = "gpt2-tiny", 2
SCHEDULES = ("gpipe", "1f1b", "2bw", "wpipe", "ftpipe")
STEPS = (10, 100_000)
ROUNDS = 2
TARGET_S = 2.0
# One more ftpipe case: checkpoints every 100 steps cut the run into 1,000 drained segments.
CASES = [(s, ()) for s in SCHEDULES] + [("ftpipe", ("--save-every", "100"))]


def _peak_mib(pid: int) -> float | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


def _cpu_s(pid: int) -> float | None:
    """CPU seconds the process has used (user + system), or None off Linux."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def first_step(
    folder: Path, package: str, argv: list[str], tag: str, logs_dir: Path, timeout=300
) -> dict:
    """Launch GPUS ranks of `package` in `folder`; seconds until rank 0 logs step 1, and each
    rank's peak memory then (MiB). The ranks are stopped there. Their logs and rendezvous go
    to `logs_dir`, not beside the package: the compile's folder holds only what compile writes
    (a later `compile --force` there refuses to delete anything else)."""
    logs_dir.mkdir(parents=True, exist_ok=True)
    store = logs_dir / f"store-{tag}-{time.monotonic_ns()}"
    cmd = [sys.executable, "-m", package, "--device", "cpu", "--log-every", "1"]
    cmd += ["--init-method", f"file://{store}", *argv]
    procs, logs = [], []
    watchdog = threading.Timer(timeout, lambda: [p.kill() for p in procs])
    begun = time.perf_counter()
    try:
        for rank in range(GPUS):
            env = child_env(pythonpath=[folder])
            env.update(RANK=str(rank), WORLD_SIZE=str(GPUS), LOCAL_RANK=str(rank))
            log = logs_dir / f"{tag}.rank{rank}.log"
            logs.append(log)
            out = subprocess.PIPE if rank == 0 else open(log, "w")  # noqa: SIM115 - closed below
            procs.append(
                subprocess.Popen(
                    cmd, cwd=folder, env=env, stderr=out, stdout=subprocess.DEVNULL, text=True
                )
            )
            if rank:
                out.close()
        watchdog.start()  # a rank that hangs silently: its stderr then ends too
        seen = []
        for line in procs[0].stderr:
            seen.append(line)
            if "step 1/" in line:  # after the log line's time and rank
                seconds = time.perf_counter() - begun
                break
        else:
            said = "".join(seen[-20:]) + logs[-1].read_text()[-2000:]
            raise RuntimeError(f"{tag}: rank 0 ended before step 1 (or {timeout} s):\n{said}")
        return {
            "seconds": seconds,
            "cpu_s": [_cpu_s(p.pid) for p in procs],
            "peak_mib": [_peak_mib(p.pid) for p in procs],
        }
    finally:
        watchdog.cancel()
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
            if p.stderr is not None:
                p.stderr.close()
        store.unlink(missing_ok=True)


def compile_packages(work: Path) -> dict:
    """The packages, compiled (analytic costs: nothing timed). WPipe runs on a plan of its own
    (two stages per GPU, in a loop); the rest share one."""
    return {
        plan: compile_plan(work / plan, MODEL, GPUS, schedule=plan)["package"]
        for plan in ("ftpipe", "wpipe")
    }


def measure(work: Path | None = None, rounds: int = ROUNDS) -> dict:
    work = Path(work or WORK)
    packages = {plan: Path(p) for plan, p in take(work, compile_packages).items()}
    runs: dict = {}
    with OtherLoad() as load:
        for _ in range(rounds):
            for schedule, extra in CASES:
                pkg = packages["wpipe" if schedule == "wpipe" else "ftpipe"]
                for steps in STEPS:
                    argv = ["--steps", str(steps), "--schedule", schedule, *extra]
                    argv += ["--checkpoint-dir", str(work / "ckpt" / f"{schedule}-{steps}")]
                    tag = f"{schedule}{''.join(extra)}-{steps}"
                    tries = runs.setdefault(" ".join([schedule, *extra]), {})
                    tries.setdefault(str(steps), []).append(
                        first_step(pkg.parent, pkg.name, argv, tag, work / "logs")
                    )
    rows = [_row(case, by_steps) for case, by_steps in runs.items()]
    return {
        "model": MODEL,
        "gpus": GPUS,
        "rounds": rounds,
        "steps": list(STEPS),
        "target_s": TARGET_S,
        "rows": rows,
        "met": all(r["extra_s"] < TARGET_S for r in rows),
        "other_load_cores": load.cores,
    }


# (run, alone): the compiles beside other compute-only parts, the launches timed alone
PARTS = {"compile": (partial(prepare, WORK, compile_packages), False), "": (measure, True)}
combine = timed_only


def _row(case: str, by_steps: dict) -> dict:
    """The least disturbed try of each step count (the machine is shared: disturbances only
    add time), and the CPU seconds the busier rank had used by then (median)."""
    row: dict = {"case": case}
    for steps, tries in by_steps.items():
        row[steps] = {
            "seconds": min(t["seconds"] for t in tries),
            "all_seconds": [t["seconds"] for t in tries],
            "cpu_s": statistics.median(max(c or 0.0 for c in t["cpu_s"]) for t in tries),
            "peak_mib": max(max(m or 0.0 for m in t["peak_mib"]) for t in tries),
        }
    short, long = (str(s) for s in STEPS)
    row["extra_s"] = row[long]["seconds"] - row[short]["seconds"]
    row["extra_cpu_s"] = row[long]["cpu_s"] - row[short]["cpu_s"]
    return row


def markdown(data: dict) -> str:
    short, long = (str(s) for s in data["steps"])
    n = f"{int(long):,}"
    load = data.get("other_load_cores")
    lines = [
        f"## Startup: --steps {n} against --steps {short}",
        "",
        f"From launching the {data['model']} package on {data['gpus']} CPU ranks to rank 0's "
        "log line of step 1 (set-up plus that one step): wall seconds, the fastest of "
        f"{data['rounds']} alternating rounds; CPU seconds the busier rank had used by then "
        "(median; less disturbed by other processes); the larger rank's peak resident memory "
        "then. The actions are made a step window at a time, so the step count should not "
        f"matter; target: under {data['target_s']:g} s more for {n} steps."
        + (f" Other processes used {load:.2f} cores meanwhile." if load is not None else ""),
        "",
        f"| schedule | wall s ({short}) | wall s ({n}) | more | CPU s ({short}) | "
        f"CPU s ({n}) | more | peak MiB ({short}) | peak MiB ({n}) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in data["rows"]:
        a, b = r[short], r[long]
        lines.append(
            f"| {r['case']} | {a['seconds']:.2f} | {b['seconds']:.2f} | {r['extra_s']:+.2f} | "
            f"{a['cpu_s']:.2f} | {b['cpu_s']:.2f} | {r['extra_cpu_s']:+.2f} | "
            f"{a['peak_mib']:.0f} | {b['peak_mib']:.0f} |"
        )
    verdict = "met for every schedule" if data["met"] else "NOT met"
    lines += ["", f"Target {verdict}.", ""]
    return "\n".join(lines)
