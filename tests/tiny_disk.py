"""A real full disk for tests: a small tmpfs mounted in the test's folder, filled to the last
byte. Mounting needs root (or CAP_SYS_ADMIN): elsewhere the tests that use it are skipped.

    def test_x(tiny_disk):        # the fixture (tests/conftest.py)
        disk = tiny_disk()        # an empty file system of 64 MiB, unmounted afterwards
        ...                       # write the previous, good files
        fill(disk)                # no byte left: the next write fails with ENOSPC
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import subprocess
from pathlib import Path

import pytest

BALLAST = "ballast"  # the file that fills the disk (not part of what a test compares)


@pytest.fixture
def tiny_disk(tmp_path):
    """mount(size="64m") -> the folder of a new tmpfs of that size (skipped where mounting
    is not allowed); every one is unmounted after the test."""
    mounted: list[Path] = []

    def mount(size: str = "64m") -> Path:
        folder = tmp_path / f"disk{len(mounted)}"
        folder.mkdir()
        if shutil.which("mount") is None:
            pytest.skip("no mount command here")
        cmd = ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(folder)]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode:
            pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
        mounted.append(folder)
        return folder

    yield mount
    for folder in mounted:
        subprocess.run(["umount", "-l", str(folder)], capture_output=True)


def fill(disk: Path) -> Path:
    """Write `disk/ballast` until the file system has no byte left; returns its path."""
    path = disk / BALLAST
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    try:
        for size in (1 << 20, 4096, 1):
            chunk = b"\0" * size
            with contextlib.suppress(OSError):
                while os.write(fd, chunk):
                    pass
    finally:
        os.close(fd)
    probe = disk / "probe"
    with pytest.raises(OSError) as full, open(probe, "wb") as f:
        f.write(b"x")
        f.flush()
    probe.unlink()
    assert full.value.errno == errno.ENOSPC
    return path


def snapshot(folder: Path) -> dict[str, bytes]:
    """Every file under `folder` but the ballast, by relative path, with its bytes."""
    return {
        str(p.relative_to(folder)): p.read_bytes()
        for p in sorted(folder.rglob("*"))
        if p.is_file() and p.name != BALLAST
    }
