"""The atomic writer: a failure at any point leaves the previous file byte-identical."""

from __future__ import annotations

import errno
import os
import stat
import subprocess
import sys
import textwrap

import pytest
from ftpipe_runtime.atomic import (
    atomic_open,
    check_writable_file,
    overlap,
    remove_temporaries,
    write_atomic,
)
from ftpipe_runtime.errors import WriteFailed
from runtime_helpers import RUNTIME_HOME

OLD = b'{"the": "previous, good file"}\n'


def _disk_full(*_):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def test_a_full_disk_at_the_flush_leaves_the_previous_file(tmp_path, monkeypatch):
    target = tmp_path / "plan.json"
    target.write_bytes(OLD)
    monkeypatch.setattr(os, "fsync", _disk_full)
    with pytest.raises(WriteFailed) as failed:
        write_atomic(target, "x" * 100_000)
    assert str(failed.value).startswith(f"cannot write {target}: No space left on device (")
    assert str(failed.value).endswith(
        " free there, 97.7 KiB needed); free some space or write elsewhere; the previous file "
        "is unchanged"
    )
    assert target.read_bytes() == OLD
    assert [p.name for p in tmp_path.iterdir()] == ["plan.json"]


def test_an_exception_mid_write_leaves_the_previous_file(tmp_path):
    target = tmp_path / "stage-0.pt"
    target.write_bytes(OLD)
    with pytest.raises(ZeroDivisionError), atomic_open(target, "wb") as f:
        f.write(b"half of the new file")
        raise ZeroDivisionError("the work failed half-way")
    assert target.read_bytes() == OLD
    assert [p.name for p in tmp_path.iterdir()] == ["stage-0.pt"]


def test_a_real_file_size_limit_mid_write(tmp_path):
    """RLIMIT_FSIZE makes the kernel refuse writes past 4 KiB, as a full disk would."""
    target = tmp_path / "graph.json"
    target.write_bytes(OLD)
    script = textwrap.dedent(
        f"""
        import resource, signal, sys
        sys.path.insert(0, {RUNTIME_HOME!r})
        from ftpipe_runtime.atomic import write_atomic
        from ftpipe_runtime.errors import WriteFailed
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # EFBIG instead of being killed
        resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))
        try:
            write_atomic({str(target)!r}, "y" * 1_000_000)
        except WriteFailed as e:
            print(e)
        """
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert "cannot write" in out.stdout and "the previous file is unchanged" in out.stdout, out
    assert target.read_bytes() == OLD
    assert [p.name for p in tmp_path.iterdir()] == ["graph.json"]


def test_written_files_are_whole_with_ordinary_permissions(tmp_path):
    write_atomic(tmp_path / "a.txt", "text")
    write_atomic(tmp_path / "b.bin", b"\x00\x01")
    assert (tmp_path / "a.txt").read_text() == "text"
    assert (tmp_path / "b.bin").read_bytes() == b"\x00\x01"
    umask = os.umask(0)
    os.umask(umask)
    assert stat.S_IMODE((tmp_path / "a.txt").stat().st_mode) == 0o666 & ~umask


def test_writability_is_checked_up_front(tmp_path):
    check_writable_file(tmp_path / "log.json")
    assert not list(tmp_path.iterdir())  # the probe leaves nothing
    with pytest.raises(WriteFailed, match="the folder .*missing does not exist"):
        check_writable_file(tmp_path / "missing" / "log.json")
    with pytest.raises(WriteFailed, match="it is a folder"):
        check_writable_file(tmp_path)
    (tmp_path / "file").write_text("")
    with pytest.raises(WriteFailed, match="the report .*r.html: .*file is a file, not a folder"):
        check_writable_file(tmp_path / "file" / "r.html", "the report")
    with pytest.raises(WriteFailed, match="the report .*r.html: .*file is a file, not a folder"):
        check_writable_file(tmp_path / "file" / "deeper" / "r.html", "the report")


def test_only_our_own_temporaries_are_removed(tmp_path):
    ours = tmp_path / "step-000002" / ".stage-0.pt.123-89abcdef.tmp"
    ours.parent.mkdir()
    ours.write_bytes(b"half")
    theirs = tmp_path / ".notes.tmp"
    theirs.write_text("a user's file")
    assert remove_temporaries(tmp_path) == [ours]
    assert theirs.exists()


def test_overlap_says_how_an_output_meets_an_input(tmp_path):
    """The one judgement behind compile's -o, simulate's --report and the run's --log-json and
    --save-hf: the same path (or a hard link to it), an output folder holding an input, an
    output inside an input folder; apart, or an input that does not exist: None."""
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    data = tmp_path / "train.jsonl"
    data.write_text("{}\n")
    os.link(data, tmp_path / "linked.jsonl")
    inputs = {"the model folder": model, "--data": data, "--init": tmp_path / "missing.pt"}
    assert overlap(data, inputs) == ("is", "--data", data)
    assert overlap(tmp_path / "linked.jsonl", inputs) == ("is", "--data", data)
    assert overlap(tmp_path, inputs) == ("holds", "the model folder", model)
    assert overlap(model / "out", inputs) == ("inside", "the model folder", model)
    assert overlap(model / "out", inputs, inside=False) is None
    assert overlap(tmp_path / "out", inputs) is None
    assert overlap(tmp_path / "missing.pt", inputs) is None  # nothing there to lose
