"""output_folder: whole or nothing, never missing, ordinary permissions, no debris, and
an unwritable target refused before any work."""

from __future__ import annotations

import multiprocessing
import os
import re
import stat
import subprocess
import threading

import pytest
from click.testing import CliRunner
from ftpipe_runtime import atomic

from ftpipe_compiler.cli import cli
from ftpipe_compiler.errors import FtpipeError, OutputExistsError
from ftpipe_compiler.output import output_folder


def _write(out, text, force=True):
    with output_folder(out, force=force) as tmp:
        (tmp / "a.txt").write_text(text)
        (tmp / "b.txt").write_text(text)


def _debris(parent):
    return [p.name for p in parent.iterdir() if p.name.startswith(".")]


@pytest.fixture
def read_only_dir(tmp_path):
    """A folder nobody may write, not even root (chattr +i), or skip where that cannot be."""
    folder = tmp_path / "locked"
    folder.mkdir()
    os.chmod(folder, 0o555)
    locked = subprocess.run(["chattr", "+i", str(folder)], capture_output=True).returncode == 0
    try:
        (folder / "probe").touch()
    except OSError:
        yield folder
    else:
        pytest.skip("cannot make a read-only folder here")
    finally:
        if locked:
            subprocess.run(["chattr", "-i", str(folder)], capture_output=True)
        os.chmod(folder, 0o755)


def test_an_error_in_the_body_or_the_swap_changes_nothing(tmp_path, monkeypatch):
    out = tmp_path / "out"
    _write(out, "old")
    with pytest.raises(ZeroDivisionError), output_folder(out, force=True) as tmp:
        (tmp / "a.txt").write_text("new")
        raise ZeroDivisionError("the work failed half-way")

    def broken_swap(tmp, out, replace):
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(atomic, "swap_folder", broken_swap)
    with pytest.raises(FtpipeError, match="cannot put .*out in place: Input/output error"):
        _write(out, "new")
    assert (out / "a.txt").read_text() == "old" and not _debris(tmp_path)


def test_the_folder_has_ordinary_permissions(tmp_path):
    _write(tmp_path / "out", "x")
    umask = os.umask(0)
    os.umask(umask)
    assert stat.S_IMODE((tmp_path / "out").stat().st_mode) == 0o777 & ~umask


def test_the_output_folder_never_stops_existing(tmp_path, monkeypatch):
    out = tmp_path / "out"
    _write(out, "0")
    asides = []
    real_rename = os.rename
    monkeypatch.setattr(
        os, "rename", lambda a, b: (asides.append(b) if a == out else None, real_rename(a, b))[1]
    )
    missing, stop = [], threading.Event()

    def watch():
        while not stop.is_set():
            if not (out / "a.txt").exists():
                missing.append(1)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        for i in range(30):
            _write(out, str(i))
    finally:
        stop.set()
        watcher.join()
    assert not asides and not missing  # swapped in one step, never renamed aside
    assert (out / "a.txt").read_text() == "29" and not _debris(tmp_path)


def test_without_an_atomic_swap_the_old_folder_is_renamed_aside_and_removed(tmp_path, monkeypatch):
    monkeypatch.setattr(atomic, "_exchange", lambda a, b: None)
    out = tmp_path / "out"
    _write(out, "old")
    _write(out, "new")
    assert (out / "b.txt").read_text() == "new" and not _debris(tmp_path)


def _racer(out, i, start):
    start.wait()
    for round_ in range(3):
        _write(out, f"{i}-{round_}")


def test_concurrent_force_writers_all_succeed_and_leave_no_debris(tmp_path):
    out = tmp_path / "out"
    ctx = multiprocessing.get_context("fork")
    start = ctx.Event()
    procs = [ctx.Process(target=_racer, args=(out, i, start)) for i in range(12)]
    for p in procs:
        p.start()
    start.set()
    for p in procs:
        p.join(60)
    assert [p.exitcode for p in procs] == [0] * 12
    a, b = (out / "a.txt").read_text(), (out / "b.txt").read_text()
    assert a == b and a.endswith("-2")  # one writer's whole folder, from its last round
    assert not _debris(tmp_path)


def test_refusals_come_before_any_work(tmp_path, monkeypatch, read_only_dir):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "a-file").write_text("mine")
    cases = [
        (["-o", "."], 1, "is the folder you are in"),
        (["-o", "a-file", "--force"], 2, "Directory 'a-file' is a file"),  # click's usage check
        (["-o", "a-file/out"], 1, "cannot write a-file/out: .*a-file is a file"),
        (["-o", str(read_only_dir / "out")], 1, "cannot write .*locked/out: "),
    ]

    def no_compiling(*args, **kwargs):
        raise AssertionError("compiled before refusing")

    monkeypatch.setattr("ftpipe_compiler.cli.compile_phases.costed_graph", no_compiling)
    for argv, code, message in cases:
        r = CliRunner().invoke(cli, ["compile", "-m", "gpt2-tiny", "--gpus", "2", *argv])
        assert r.exit_code == code, (argv, r.output)
        assert "Traceback" not in r.output and re.search(message, r.output), (argv, r.output)
        assert code == 2 or r.output.count("\n") == 1
    assert (tmp_path / "a-file").read_text() == "mine" and not list(read_only_dir.iterdir())


def test_a_folder_filled_meanwhile_is_not_replaced_without_force(tmp_path):
    out = tmp_path / "out"
    with pytest.raises(OutputExistsError, match="appeared while compiling"):
        with output_folder(out) as tmp:
            (tmp / "a.txt").write_text("mine")
            _write(out, "someone else's")
    assert (out / "a.txt").read_text() == "someone else's" and not _debris(tmp_path)
