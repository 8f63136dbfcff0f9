"""The one way ftpipe writes a file: whole, or not at all.

    write_atomic("plan.json", text)                 # str or bytes
    with atomic_open("stage-2.pt", "wb") as f:      # a file object
        torch.save(state, f)

Data goes to a temporary file in the target's folder (`.NAME.<pid>-<random>.tmp`), is
flushed and fsync'ed, and only then renamed over the target: `os.replace` is atomic, so a
full disk, an exception or a crash mid-write leaves the previous file byte-identical. Any
failure removes the temporary file; only a killed process can leave one behind, and
`remove_temporaries` clears those. An OSError becomes a `WriteFailed` naming the file.
The compiler imports this module too (`ftpipe_runtime.atomic`): the runtime never imports
the compiler, so the writer lives here.
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
from pathlib import Path

from .errors import WriteFailed

__all__ = [
    "atomic_open",
    "check_writable_file",
    "check_writable_folder",
    "remove_temporaries",
    "write_atomic",
]

TEMPORARY = re.compile(r"^\..+\.\d+-[0-9a-f]{8}\.tmp$")


def _temporary(path: Path) -> Path:
    return path.with_name(f".{path.name}.{os.getpid()}-{secrets.token_hex(4)}.tmp")


@contextlib.contextmanager
def atomic_open(path, mode: str = "w", encoding: str = "utf-8"):
    """A file object for `path` ("w" text or "wb" bytes) that replaces it only on success."""
    if mode not in ("w", "wb"):
        raise ValueError(f"atomic_open writes whole files: mode 'w' or 'wb', not {mode!r}")
    path = Path(path)
    tmp = _temporary(path)
    try:
        with open(tmp, mode.replace("w", "x"), encoding=None if "b" in mode else encoding) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as e:
        with contextlib.suppress(OSError):
            tmp.unlink()
        if isinstance(e, OSError) and not isinstance(e, WriteFailed):
            kept = "the previous file is unchanged" if path.exists() else "nothing was written"
            raise WriteFailed(f"cannot write {path}: {e.strerror or e}; {kept}") from e
        raise
    _sync_folder(path.parent)


def write_atomic(path, data: str | bytes) -> None:
    """Replace `path` with `data` atomically."""
    with atomic_open(path, "wb" if isinstance(data, bytes) else "w") as f:
        f.write(data)


def check_writable_file(path, what: str = "") -> None:
    """Raise WriteFailed now, before the work, if `path` could not be written at the end.
    `what` names the file in the message ("the report")."""
    path = Path(path)
    name = f"{what} {path}" if what else str(path)
    if path.is_dir():
        raise WriteFailed(f"cannot write {name}: it is a folder; give a file name")
    folder = path.parent
    if not folder.is_dir():
        raise WriteFailed(f"cannot write {name}: the folder {folder} does not exist")
    check_writable_folder(folder, name)


def check_writable_folder(folder, what: str = "") -> None:
    """Raise WriteFailed now if no file can be created in `folder` (which must exist)."""
    folder = Path(folder)
    probe = _temporary(folder / "probe")
    try:
        os.close(os.open(probe, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        probe.unlink()
    except OSError as e:
        raise WriteFailed(f"cannot write {what or folder}: {e.strerror or e} ({folder})") from None


def remove_temporaries(folder) -> list[Path]:
    """Delete the temporary files a killed writer left under `folder` (recursively)."""
    removed = []
    root = Path(folder)
    if not root.is_dir():
        return removed
    for p in root.rglob(".*.tmp"):
        if TEMPORARY.match(p.name) and p.is_file():
            with contextlib.suppress(OSError):
                p.unlink()
                removed.append(p)
    return removed


def _sync_folder(folder: Path) -> None:
    """Make the rename itself durable; not every file system lets a folder be fsync'ed."""
    with contextlib.suppress(OSError):
        fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
