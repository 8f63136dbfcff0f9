"""Every file ftpipe writes goes through the one atomic writer: with the disk full at the
moment of writing, each writer fails in one sentence and every file that existed before is
byte-identical after, with nothing left beside it. The disk is full at the flush (every
writer, everywhere), and for real: a tmpfs filled to the last byte (where mounting one is
allowed)."""

from __future__ import annotations

import errno
import functools
import json
import os
import sys
import types
from pathlib import Path

import pytest
import torch
from ftpipe_runtime import run
from ftpipe_runtime.checkpoint.store import Checkpoints
from ftpipe_runtime.errors import WriteFailed
from tiny_disk import fill, snapshot

from ftpipe_compiler.cli.compile_phases import generate
from ftpipe_compiler.codegen import generate_package
from ftpipe_compiler.costs.cache import save_profile
from ftpipe_compiler.costs.profilers import costed_graph
from ftpipe_compiler.partition import problem_from_graph, run_partitioners
from ftpipe_compiler.simulate import simulate, write_report

RUNTIME_TESTS = Path(__file__).resolve().parent / "runtime"


@functools.cache
def _compiled():
    spec, _, traced, graph = costed_graph("gpt2-tiny")
    problem = problem_from_graph(graph, 2)
    plan = run_partitioners(problem, ["even-layers"], progress=False)[0].plan
    return spec, traced, graph, plan


def _plan(folder: Path):
    _compiled()[3].save(folder / "plan.json")


def _graph(folder: Path):
    _compiled()[2].save(folder / "graph.json")


def _report(folder: Path):
    plan = _compiled()[3]
    write_report(folder / "report.html", plan, simulate(plan, steps=2))


def _profile_cache(folder: Path):
    save_profile("0123456789abcdef", _compiled()[2], cache_dir=folder)


def _package(folder: Path):
    spec, traced, graph, plan = _compiled()
    generate_package(traced, graph, plan, spec, folder, command="pytest", force=True)


def _compile_output(folder: Path):
    """What `ftpipe compile` writes: plan.json, report.html and the package, as one folder."""
    spec, traced, graph, plan = _compiled()
    job = types.SimpleNamespace(out=folder / "out", force=True, plan=plan, command="pytest",
                                sim=simulate(plan, steps=2), traced=traced, graph=graph,
                                spec=spec, shrinks=[], inputs={})  # fmt: skip
    generate(job, lambda done, total, what: None)


def _checkpoint(folder: Path):
    ckpt = Checkpoints(folder, 0, 1, run={"plan": "p"})
    ckpt.save_stage(2, 0, torch.nn.Linear(2, 2), None)


def _log_json(folder: Path):
    if str(RUNTIME_TESTS) not in sys.path:
        sys.path.insert(0, str(RUNTIME_TESTS))
    from runtime_toy import STAGES, one_rank_plan

    argv = ["--steps", "1", "--log-json", str(folder / "log.json")]
    try:
        run(one_rank_plan(), STAGES, argv + ["--checkpoint-dir", str(folder / "ckpt")])
    except SystemExit as e:
        raise WriteFailed(str(e.code)) from None


def _benchmarks(folder: Path):
    from benchmarks import __main__ as bench
    from benchmarks.sections import Section

    sections = {"plans": Section(lambda data: "## a section\n", {"": (lambda: {"x": 1.0}, True)})}
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(bench, "SECTIONS", sections)
        bench.main(["--sections", "plans", "--out", str(folder / "BENCHMARKS.md")])


WRITERS = {
    "Plan.save": _plan,
    "OpGraph.save": _graph,
    "report": _report,
    "profile cache": _profile_cache,
    "package": _package,
    "compile output": _compile_output,
    "checkpoint": _checkpoint,
    "--log-json": _log_json,
    "BENCHMARKS": _benchmarks,
}


def _snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in folder.rglob("*") if p.is_file()}


@pytest.mark.parametrize("writer", list(WRITERS))
def test_a_full_disk_leaves_every_previous_file_byte_identical(writer, tmp_path, monkeypatch):
    WRITERS[writer](tmp_path)  # the previous, good files
    before = _snapshot(tmp_path)
    assert before

    def disk_full(fd):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "fsync", disk_full)
    with pytest.raises(WriteFailed) as failed:
        WRITERS[writer](tmp_path)
    message = str(failed.value)
    assert "No space left on device" in message and "\n" not in message
    assert _snapshot(tmp_path) == before
    assert not [p for p in tmp_path.rglob(".*") if p.name != "__pycache__"]


def test_a_package_keeps_its_file_set(tmp_path):
    """The package is written through the writer too: the same files with and without it."""
    _package(tmp_path)
    files = sorted(p.name for p in (tmp_path / "gpt2_tiny_pipeline").iterdir())
    assert files == [
        "README.md",
        "__init__.py",
        "__main__.py",
        "plan.json",
        "stages.py",
    ]
    assert json.loads((tmp_path / "gpt2_tiny_pipeline" / "plan.json").read_text())["gpus"] == 2


@pytest.mark.parametrize("writer", list(WRITERS))
def test_a_real_full_disk_leaves_every_previous_file_byte_identical(writer, tiny_disk):
    disk = tiny_disk()
    WRITERS[writer](disk)
    before = snapshot(disk)
    fill(disk)
    with pytest.raises(WriteFailed) as failed:
        WRITERS[writer](disk)
    message = str(failed.value)
    assert "No space left on device (0.0 B free there" in message and "\n" not in message
    assert "free some space or write elsewhere" in message
    assert snapshot(disk) == before
    assert not [p for p in disk.rglob(".*") if p.name != "__pycache__"]
