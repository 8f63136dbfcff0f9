"""Shared by the runtime and fidelity benchmarks: compile plans, launch 2 CPU ranks.

    info = compile_plan(out, "gpt2-bench", gpus=2, partitioners="even-layers", schedule="1f1b")
    summary = run_package(out, info["package"], ["--steps", "6"], json_path)   # ftpipe
    torchrun(["-m", "benchmarks.harness.pipelining_worker", ...])             # any module

Every rank gets one thread (OMP_NUM_THREADS=1): two processes on the two cores of this
machine, each timed as a "GPU". A child's stderr goes to a log file beside its output,
shown when it fails.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from ftpipe_runtime.job.cpu_allocator import VARIABLE

ROOT = Path(__file__).resolve().parents[2]  # the repository: `benchmarks` imports from here


def child_env(threads: int = 1, pythonpath=(), extra: dict | None = None) -> dict:
    """The environment of a benchmark child: `threads` threads, the repo importable, torch's
    CPU allocator as the child picks it (this process has THP_MEM_ALLOC_ENABLE set if it
    imported ftpipe_runtime before torch: a package sets it itself, pipelining runs torch's
    default) unless `extra` says otherwise."""
    env = dict(os.environ)
    env.pop(VARIABLE, None)
    env.update(OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads), **(extra or {}))
    paths = [str(p) for p in pythonpath]
    if env.get("PYTHONPATH"):
        paths.append(env["PYTHONPATH"])
    paths.append(str(ROOT))
    env["PYTHONPATH"] = os.pathsep.join(paths)
    return env


def run_child(
    cmd: list[str], log: Path, cwd=ROOT, threads=1, pythonpath=(), timeout=600, extra=None
) -> str:
    """Run `cmd` (environment: `child_env`); returns its stdout, its stderr goes to `log`. A
    failure raises with both tails (a rank's traceback is on stderr)."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as err:
        done = subprocess.run(
            cmd,
            cwd=cwd,
            env=child_env(threads, pythonpath, extra),
            stdout=subprocess.PIPE,
            stderr=err,
            text=True,
            timeout=timeout,
        )
    if done.returncode != 0:
        tail = "\n".join((done.stdout + log.read_text()).splitlines()[-30:])
        raise RuntimeError(f"{' '.join(map(str, cmd))} failed ({done.returncode}):\n{tail}")
    return done.stdout


def flags(**options) -> list[str]:
    """Command-line flags: schedule="1f1b" -> --schedule 1f1b, force=True -> --force,
    cache=False -> --no-cache, None -> nothing."""
    out = []
    for key, value in options.items():
        flag = key.replace("_", "-")
        if value is True:
            out.append(f"--{flag}")
        elif value is False:
            out.append(f"--no-{flag}")
        elif value is not None:
            out += [f"--{flag}", str(value)]
    return out


def compile_plan(out: Path, model: str, gpus: int, threads: int = 1, **options) -> dict:
    """`ftpipe compile ... --json` in a child; `options` are its flags (see `flags`). A
    measured profile then runs on `threads` threads, like the ranks it predicts."""
    cmd = [sys.executable, "-m", "ftpipe_compiler", "compile", "--model", model]
    cmd += flags(gpus=gpus, output=out, force=True, json=True, **options)
    out.parent.mkdir(parents=True, exist_ok=True)  # and run there: `-m` puts the cwd first
    text = run_child(cmd, out.with_name(out.name + ".compile.log"), cwd=out.parent, threads=threads)
    return json.loads(text[text.index("{") :])


def torchrun(
    args: list[str], log: Path, cwd=ROOT, nproc: int = 2, pythonpath=(), extra=None, timeout=600
) -> str:
    """`torchrun --standalone --nproc_per_node nproc ARGS`, one thread per rank (`extra`:
    environment variables, `child_env`)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    cmd += ["--nproc_per_node", str(nproc), *map(str, args)]
    return run_child(cmd, log, cwd=cwd, pythonpath=pythonpath, extra=extra, timeout=timeout)


def run_package(
    out: Path,
    package: str,
    argv: list[str],
    result: Path,
    gpus: int = 2,
    actions: bool = False,
    timeout: float = 600,
) -> dict:
    """Train the generated package in `out` on `gpus` ranks, as its users run it; returns the
    runtime's summary (`--log-json`) plus `step_ends_s`: its segments' step ends, one after
    the other (and with `actions`, `action_files`: the run's `--trace`)."""
    trace = Path(f"{result}.trace.json")
    argv = [*argv, "--trace", str(trace)] if actions else argv
    torchrun(
        ["-m", package, "--device", "cpu", "--log-json", result, *argv],
        result.with_suffix(".log"),
        cwd=out,
        nproc=gpus,
        pythonpath=[out],
        timeout=timeout,
    )
    summary = json.loads(result.read_text())
    summary["step_ends_s"] = [t for g in summary["segments"] for t in g["step_ends_s"]]
    if actions and trace.exists():
        summary["action_files"] = [str(trace)]
    return summary
