"""Shared by the runtime and fidelity benchmarks: compile plans, launch 2 CPU ranks.

    info = compile_plan(out, "gpt2-bench", gpus=2, partitioners="even-layers", schedule="1f1b")
    summary = run_package(out, info["package"], ["--steps", "6"], json_path)   # ftpipe
    torchrun(["-m", "benchmarks.harness.pipelining_worker", ...])  # any module, on 2 ranks

Every rank gets one thread (OMP_NUM_THREADS=1): two processes on the two cores of this
machine, each timed as a "GPU". A child's stderr goes to a log file beside its output,
shown when it fails.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack
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
    """`python ARGS` on `nproc` ranks started as `torchrun --standalone --nproc_per_node nproc`
    starts them, without its agent (which imports torch, ~3 s, before any rank starts): RANK,
    WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, and env://'s MASTER_ADDR and a free MASTER_PORT
    (rank 0 holds the store), one thread per rank (`extra`: environment variables,
    `child_env`). Returns the ranks' stdout; their stderr goes to `log`, rank by rank. A rank
    that fails, or a run past `timeout`, stops the others (SIGTERM, as torchrun does) and
    raises with that rank's tail."""
    log.parent.mkdir(parents=True, exist_ok=True)
    env = child_env(1, pythonpath, extra)
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
    env.update(WORLD_SIZE=str(nproc), LOCAL_WORLD_SIZE=str(nproc))
    cmd = [sys.executable, "-u", *map(str, args)]  # unbuffered, as torchrun runs a rank
    errs = [log.with_name(f"{log.name}.rank{r}") for r in range(nproc)]
    with tempfile.TemporaryFile("w+") as out, ExitStack() as files:
        ranks = []
        for r, err in enumerate(errs):
            rank_env = {**env, "RANK": str(r), "LOCAL_RANK": str(r)}
            sink = files.enter_context(open(err, "w"))
            ranks.append(subprocess.Popen(cmd, cwd=cwd, env=rank_env, stdout=out, stderr=sink))
        try:
            failed = _wait_all(ranks, timeout)
        finally:
            _stop(ranks)
        said = [e.read_text() for e in errs]
        log.write_text("".join(f"--- rank {r}\n{text}" for r, text in enumerate(said)))
        for e in errs:
            e.unlink()
        out.seek(0)
        stdout = out.read()
    if failed is not None:
        r, code = failed
        tail = "\n".join((stdout + said[r]).splitlines()[-30:])
        if code is None:
            raise subprocess.TimeoutExpired(cmd, timeout, output=tail)
        raise RuntimeError(f"rank {r} of {' '.join(cmd)} failed ({code}):\n{tail}")
    return stdout


def _free_port() -> int:
    """A port nothing listens on now (torchrun --standalone picks its own the same way)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_all(ranks: list[subprocess.Popen], timeout: float) -> tuple[int, int | None] | None:
    """None when every rank exits 0; else (rank, exit code) of the first that did not, or
    (rank 0, None) at `timeout`."""
    deadline = time.monotonic() + timeout
    while True:
        codes = [p.poll() for p in ranks]
        bad = next(((r, c) for r, c in enumerate(codes) if c not in (None, 0)), None)
        if bad is not None or None not in codes:
            return bad
        if time.monotonic() > deadline:
            return (0, None)
        time.sleep(0.02)


def _stop(ranks: list[subprocess.Popen], grace: float = 5.0) -> None:
    """SIGTERM to the ranks still running, SIGKILL to those still there after `grace`."""
    for p in ranks:
        if p.poll() is None:
            p.terminate()
    deadline = time.monotonic() + grace
    for p in ranks:
        try:
            p.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def run_package(
    out: Path,
    package: str,
    argv: list[str],
    result: Path,
    gpus: int = 2,
    actions: bool = False,
    timeout: float = 600,
) -> dict:
    """Train the generated package in `out` on `gpus` ranks, started as torchrun starts them
    (`torchrun`), as its users run it; returns the runtime's summary (`--log-json`) plus
    `step_ends_s`: its segments' step ends, one after the other (and with `actions`,
    `action_files`: the run's `--trace`)."""
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
