"""Costed tiny models (traced on `meta`, as `ftpipe compile` does) and plans built by hand."""

from __future__ import annotations

import functools
import shutil
import subprocess
import sys
from pathlib import Path

from ftpipe_compiler.costs.hardware import get_hardware
from ftpipe_compiler.costs.profilers import costed_graph
from ftpipe_compiler.partition import build_plan
from ftpipe_compiler.partition.problem import Problem

TINY = ("t5-tiny", "gpt2-tiny", "bert-tiny")
REPO = Path(__file__).resolve().parents[2]


@functools.cache
def costed(model: str, granularity: str = "op", task: str | None = None):
    """(spec, task, traced, graph), traced once per test session."""
    return costed_graph(model, task=task, granularity=granularity)


def problem(graph, gpus: int = 2) -> Problem:
    # Memory is not what these tests are about: give every plan room.
    return Problem(graph, gpus=gpus, hardware=get_hardware("rtx2080ti"), memory_bytes=2**50)


def plan_from_cuts(graph, cuts, gpu_of=None, gpus: int = 2):
    """Stages = runs of the topological order split before each index in `cuts`."""
    stage_of, s = {}, 0
    for i, node in enumerate(graph.nodes):
        while s < len(cuts) and i >= cuts[s]:
            s += 1
        stage_of[node.id] = s
    k = len(cuts) + 1
    gpu_of = gpu_of or {x: x % gpus for x in range(k)}
    return build_plan(problem(graph, gpus), stage_of, gpu_of, "test")


def contiguous(graph, k: int, gpus: int | None = None):
    """k equal chunks of the node order; stage i on GPU i % gpus (Mixed-style when k > gpus)."""
    n = len(graph.nodes)
    gpus = gpus or k
    return plan_from_cuts(
        graph, [i * n // k for i in range(1, k)], {s: s % gpus for s in range(k)}, gpus
    )


def ruff_check(path) -> subprocess.CompletedProcess | None:
    """`ruff check` with the repository's rules on `path`; None when ruff is not installed."""
    cmd = [sys.executable, "-m", "ruff"]
    probe = subprocess.run([*cmd, "--version"], capture_output=True)
    if probe.returncode != 0:
        if shutil.which("ruff") is None:
            return None
        cmd = ["ruff"]
    return subprocess.run(
        [*cmd, "check", "--no-cache", "--config", str(REPO / "ruff.toml"), str(path)],
        capture_output=True,
        text=True,
    )
