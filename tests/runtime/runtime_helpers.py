"""Launching toy pipelines: one subprocess per rank, rendezvous through a file store."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import ftpipe_runtime
import pytest

HERE = Path(__file__).parent
TOY = HERE / "runtime_toy.py"
# Where ftpipe_runtime was found (an install, or a folder on PYTHONPATH): children use it too.
RUNTIME_HOME = str(Path(ftpipe_runtime.__path__[0]).parent)


class Ranks:
    """The processes of one pipeline run and their captured stderr."""

    def __init__(self, procs, logs):
        self.procs, self.logs = procs, logs

    def wait(self, timeout: float = 120) -> list[int]:
        deadline = time.monotonic() + timeout
        codes = []
        for p in self.procs:
            try:
                codes.append(p.wait(timeout=max(deadline - time.monotonic(), 0.1)))
            except subprocess.TimeoutExpired:
                self.kill()
                raise AssertionError(
                    f"ranks still running after {timeout} s:\n{self.stderr()}"
                ) from None
        return codes

    def kill(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
                p.wait()

    def stderr(self, rank: int | None = None) -> str:
        ranks = range(len(self.logs)) if rank is None else [rank]
        return "\n".join(f"--- rank {r}\n{Path(self.logs[r]).read_text()}" for r in ranks)


def launch(
    tmp_path: Path, plan: dict, argv: list[str], name: str = "run", env=None, module=None, cwd=None
) -> Ranks:
    """Start the plan's ranks (every GPU of every replica) of the toy pipeline, or of
    `python -m module` run in `cwd`."""
    plan_file = tmp_path / f"{name}-plan.json"
    plan_file.write_text(json.dumps(plan))
    store = tmp_path / f"{name}-store"
    world = plan["gpus"] * plan.get("replicas", 1)
    procs, logs = [], []
    cmd = [sys.executable, "-m", module] if module else [sys.executable, str(TOY), str(plan_file)]
    for rank in range(world):
        child = {
            **os.environ,
            "RANK": str(rank),
            "WORLD_SIZE": str(world),
            "LOCAL_RANK": str(rank),
            "LOCAL_WORLD_SIZE": str(world),
            "OMP_NUM_THREADS": "1",
            "PYTHONPATH": os.pathsep.join([RUNTIME_HOME, os.environ.get("PYTHONPATH", "")]),
            **(env or {}),
        }
        log = tmp_path / f"{name}-rank{rank}.log"
        logs.append(log)
        with open(log, "w") as err:
            procs.append(
                subprocess.Popen(
                    [*cmd, "--init-method", f"file://{store}", *argv],
                    env=child,
                    stdout=err,
                    stderr=err,
                    cwd=cwd,
                )
            )
    return Ranks(procs, logs)


@pytest.fixture
def run_pipeline(tmp_path):
    """run_pipeline(plan, argv) -> (return codes, Ranks); waits at most two minutes."""
    started = []

    def go(plan, argv, name="run", env=None, timeout=120, module=None, cwd=None):
        ranks = launch(tmp_path, plan, argv, name, env, module, cwd)
        started.append(ranks)
        return ranks.wait(timeout), ranks

    yield go
    for ranks in started:
        ranks.kill()
