"""Launching toy pipelines: one process per rank, rendezvous through a file store.

Ranks are forked from servers that hold torch imported (`rank_server`: ~4.5 s of CPU a rank
saved, minutes over the suite), but for the tests that measure what a cold start includes
(`COLD`, `launch(fork=False)`). FTPIPE_TEST_COLD_RANKS=1 starts every rank cold (what the suite
did before)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import ftpipe_runtime
import pytest
import torch
from ftpipe_runtime.spec.plan import read_plan
from rank_server import fork_rank, warm

HERE = Path(__file__).parent
TOY = HERE / "runtime_toy.py"
# Test modules whose ranks start cold: what they measure includes the process's own start.
COLD = {"test_memory_plan.py": "a rank's peak is its resident set, the server's pages not in it"}
# Where ftpipe_runtime was found (an install, or a folder on PYTHONPATH): children use it too.
RUNTIME_HOME = str(Path(ftpipe_runtime.__path__[0]).parent)


def plan_json(path) -> dict:
    """A package's plan as the run's modules read it: checked by the one reader, its model's
    folder found, as its JSON object."""
    return read_plan(path).to_dict()


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
    tmp_path: Path,
    plan: dict,
    argv: list[str],
    name: str = "run",
    env=None,
    module=None,
    cwd=None,
    fork: bool = True,
) -> Ranks:
    """Start the plan's ranks (every GPU of every replica) of the toy pipeline, or of
    `python -m module` run in `cwd`; `fork`: from `rank_server`'s warm interpreters."""
    fork = fork and not os.environ.get("FTPIPE_TEST_COLD_RANKS")
    plan_file = tmp_path / f"{name}-plan.json"
    plan_file.write_text(json.dumps(plan))
    store = tmp_path / f"{name}-store"
    world = plan["gpus"] * plan.get("replicas", 1)
    procs, logs = [], []
    cmd = [sys.executable, "-m", module] if module else [sys.executable, str(TOY), str(plan_file)]
    children = [
        {
            **os.environ,
            "RANK": str(rank),
            "WORLD_SIZE": str(world),
            "LOCAL_RANK": str(rank),
            "LOCAL_WORLD_SIZE": str(world),
            "OMP_NUM_THREADS": "1",
            "PYTHONPATH": os.pathsep.join([RUNTIME_HOME, os.environ.get("PYTHONPATH", "")]),
            **(env or {}),
        }
        for rank in range(world)
    ]
    prepared = module is not None  # a package's __init__ calls prepare_process() before torch
    if fork:
        warm(list(enumerate(children)), prepared)
    for rank, child in enumerate(children):
        log = tmp_path / f"{name}-rank{rank}.log"
        logs.append(log)
        if fork:  # the same command line, less the interpreter
            line = [*map(str, cmd[1:]), "--init-method", f"file://{store}", *argv]
            where = None if cwd is None else str(cwd)
            procs.append(fork_rank(rank, line, child, where, log, prepared))
            continue
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
def run_pipeline(tmp_path, request):
    """run_pipeline(plan, argv) -> (return codes, Ranks); waits at most two minutes."""
    started = []
    fork = request.path.name not in COLD

    def go(plan, argv, name="run", env=None, timeout=120, module=None, cwd=None):
        ranks = launch(tmp_path, plan, argv, name, env, module, cwd, fork)
        started.append(ranks)
        return ranks.wait(timeout), ranks

    yield go
    for ranks in started:
        ranks.kill()


def crash_and_resume(run_pipeline, tmp_path, plan, argv, stages, fault="1:4:exit", **launch):
    """Run `argv` (it must save checkpoints) whole; run it again stopped by FTPIPE_FAULT after a
    checkpoint, and resume it; assert both end with bit-identical weights. Returns the two
    --log-json summaries (whole, resumed). `launch`: env, module, cwd of run_pipeline."""
    from runtime_reference import checkpoint_params  # (a torch-heavy module: import late)

    env = launch.pop("env", None) or {}
    steps = int(argv[argv.index("--steps") + 1])
    runs = {}
    for name, extra, more_env in [
        ("whole", [], {}),
        ("crash", [], {"FTPIPE_FAULT": fault}),
        ("resume", ["--resume"], {}),
    ]:
        folder = tmp_path / ("whole" if name == "whole" else "broken")
        log = tmp_path / f"{name}.json"
        own = [*argv, *extra, "--checkpoint-dir", str(folder), "--log-json", str(log)]
        codes, ranks = run_pipeline(plan, own, name=name, env={**env, **more_env}, **launch)
        if name == "crash":
            assert all(c != 0 for c in codes), ranks.stderr()
            assert not (folder / f"step-{steps:06d}").exists()
        else:
            assert codes == [0] * len(codes), ranks.stderr()
            runs[name] = json.loads(log.read_text())
    a = checkpoint_params(tmp_path / "whole", steps, stages)
    b = checkpoint_params(tmp_path / "broken", steps, stages)
    for name in a:
        assert torch.equal(a[name], b[name]), name
    return runs["whole"], runs["resume"]
