"""What the cases do to their folder before the command runs: each helper returns a setup,
`setup(folder)`, whose docstring is what the table says was done.

    truncate("ck/step-000004/rank-0.json")      # cut to half its bytes
    full_disk("out")                            # a tmpfs mounted there, no byte left
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
from pathlib import Path

__all__ = [
    "both",
    "copy",
    "edit_json",
    "folder_instead",
    "full_disk",
    "garbage",
    "link_loop",
    "read_only",
    "remove",
    "said",
    "truncate",
    "write",
]


def said(text: str):
    """Give a setup its words for the table."""

    def name(setup):
        setup.__doc__ = text
        return setup

    return name


def write(path: str, data: str | bytes, what: str = ""):
    @said(what or f"{path} written ({len(data)} bytes)")
    def setup(folder: Path):
        p = folder / path
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(data if isinstance(data, bytes) else data.encode())

    return setup


def truncate(path: str, keep: float = 0.5):
    @said(f"{path} cut to {keep:.0%} of its bytes" if keep else f"{path} emptied (0 bytes)")
    def setup(folder: Path):
        p = folder / path
        data = p.read_bytes()
        p.write_bytes(data[: int(len(data) * keep)])

    return setup


def garbage(path: str, size: int = 4096):
    @said(f"{path} replaced by {size} random bytes")
    def setup(folder: Path):
        p = folder / path
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(bytes((i * 7919 + 13) % 256 for i in range(size)))

    return setup


def edit_json(path: str, edit, what: str):
    """`edit(obj)` changes the JSON of `path` in place (or returns a new one)."""

    @said(what)
    def setup(folder: Path):
        p = folder / path
        obj = json.loads(p.read_text())
        new = edit(obj)
        p.write_text(json.dumps(obj if new is None else new))

    return setup


def remove(path: str):
    @said(f"{path} removed")
    def setup(folder: Path):
        p = folder / path
        shutil.rmtree(p) if p.is_dir() else p.unlink()

    return setup


def copy(source: str, target: str, what: str = ""):
    @said(what or f"{source} copied to {target}")
    def setup(folder: Path):
        s, t = folder / source, folder / target
        t.parent.mkdir(parents=True, exist_ok=True)
        shutil.copytree(s, t, symlinks=True) if s.is_dir() else shutil.copy(s, t)

    return setup


def link_loop(path: str):
    @said(f"{path} is a symlink to itself")
    def setup(folder: Path):
        p = folder / path
        p.parent.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(FileNotFoundError):
            shutil.rmtree(p) if p.is_dir() and not p.is_symlink() else p.unlink()
        os.symlink(p.name, p)

    return setup


def folder_instead(path: str):
    @said(f"{path} is a folder")
    def setup(folder: Path):
        p = folder / path
        p.unlink()
        p.mkdir()
        (p / "x").write_text("x")

    return setup


def both(*setups, what: str = ""):
    @said(what or "; ".join(s.__doc__ or "" for s in setups))
    def setup(folder: Path):
        for s in setups:
            s(folder)

    return setup


def _mount(where: Path, size: str, options: str = "") -> None:
    where.mkdir(parents=True, exist_ok=True)
    opts = f"size={size}" + (f",{options}" if options else "")
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", opts, "tmpfs", str(where)],
                          capture_output=True, text=True)  # fmt: skip
    if done.returncode:
        raise RuntimeError(f"cannot mount a tmpfs at {where}: {done.stderr.strip()}")


def full_disk(path: str, keep: tuple[str, ...] = (), size: str = "16m", fill: bool = True):
    """A small tmpfs at `path` holding copies of `keep` (paths in the case folder, e.g. an
    earlier output), then filled to the last byte (`fill`; else `size` is all it holds)."""

    what = "a full disk" if fill else f"a disk of {size}"

    @said(f"{path} is {what}" + (f" holding {', '.join(keep)}" if keep else ""))
    def setup(folder: Path):
        where = folder / path
        held = {}
        for k in keep:  # moved aside, then back onto the new disk
            held[k] = folder / f".keep-{len(held)}"
            shutil.move(folder / k, held[k])
        _mount(where, size)
        for k, tmp in held.items():
            shutil.move(tmp, folder / k)
        if not fill:
            return
        fd = os.open(where / "ballast", os.O_WRONLY | os.O_CREAT | os.O_APPEND)
        try:
            for chunk in (1 << 20, 4096, 1):
                with contextlib.suppress(OSError):
                    while os.write(fd, b"\0" * chunk):
                        pass
        finally:
            os.close(fd)

    return setup


def read_only(path: str, keep: tuple[str, ...] = ()):
    """A tmpfs at `path` holding copies of `keep`, mounted read-only (EROFS even for root)."""

    @said(f"{path} is a read-only file system" + (f" holding {', '.join(keep)}" if keep else ""))
    def setup(folder: Path):
        where = folder / path
        held = {}
        for k in keep:
            held[k] = folder / f".keep-{len(held)}"
            shutil.move(folder / k, held[k])
        _mount(where, "16m")
        for k, tmp in held.items():
            shutil.move(tmp, folder / k)
        done = subprocess.run(["mount", "-o", "remount,ro", str(where)], capture_output=True,
                              text=True)  # fmt: skip
        if done.returncode:
            raise RuntimeError(f"cannot make {where} read-only: {done.stderr.strip()}")

    return setup
