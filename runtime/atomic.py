"""The one way ftpipe writes a file: whole, or not at all.

    write_atomic("plan.json", text)                 # str or bytes
    with atomic_open("stage-2.pt", "wb") as f:      # a file object
        torch.save(state, f)
    with new_folder("out/model") as tmp:             # a folder, swapped in whole
        write_atomic(tmp / "config.json", text)

Data goes to a temporary file in the target's folder (`.NAME.<pid>-<random>.tmp`), is
flushed and fsync'ed, and only then renamed over the target: `os.replace` is atomic, so a
full disk, an exception or a crash mid-write leaves the previous file byte-identical. Any
failure removes the temporary file; only a killed process can leave one behind, and
`remove_temporaries` clears those. An OSError becomes a `WriteFailed` naming the file.

A folder is built beside its destination and swapped in with one
`renameat2(RENAME_EXCHANGE)`, so it never stops existing; where that call is missing the old
folder is renamed aside first (a window of one rename). Concurrent writers each swap in
their own complete folder: the last one wins and none leaves a `.out.xxxx` folder behind.
The compiler imports this module too (`ftpipe_runtime.atomic`): the runtime never imports
the compiler, so the writer lives here.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import re
import secrets
import shutil
import tempfile
from pathlib import Path

from .errors import WriteFailed

__all__ = [
    "atomic_open",
    "check_writable_file",
    "check_writable_folder",
    "new_folder",
    "remove_temporaries",
    "swap_folder",
    "temporary_folder",
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


@contextlib.contextmanager
def new_folder(out, replace: bool = True, error=WriteFailed, hint: str = "", exists=None):
    """A temporary folder beside `out`, put in its place whole when the block succeeds.

    `error(message)` is raised when the folder cannot be made (message + `hint`) or put in
    place (nothing changed); `exists(out)` (default FileExistsError) when `replace` is False
    and another writer filled `out` meanwhile. Errors of the block itself pass unchanged."""
    out = Path(out)
    try:
        tmp = temporary_folder(out)
    except OSError as e:
        raise error(f"cannot write {out}: {e.strerror}{hint}") from e
    try:
        yield tmp
        try:
            swap_folder(tmp, out, replace)
        except FileExistsError:
            if exists is None:
                raise
            raise exists(out) from None
        except OSError as e:
            raise error(f"cannot put {out} in place: {e.strerror}; nothing changed") from e
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # the old folder after a swap, or our leftovers


def temporary_folder(out: Path) -> Path:
    """An empty folder beside `out` with ordinary permissions, to be swapped in later."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    os.chmod(tmp, 0o777 & ~_umask())  # mkdtemp makes 0700; an output folder is ordinary
    return tmp


def swap_folder(tmp: Path, out: Path, replace: bool = True) -> None:
    """Put `tmp` at `out`; afterwards `tmp` holds the replaced folder, if there was one."""
    while True:
        try:
            os.rename(tmp, out)  # out missing or empty: done in one step
            return
        except OSError as e:
            if e.errno not in (errno.ENOTEMPTY, errno.EEXIST):
                raise
        if not replace:  # another writer filled `out` meanwhile
            raise FileExistsError(errno.EEXIST, "it is there already", str(out))
        swapped = _exchange(tmp, out)
        if swapped is None:  # no renameat2 here: rename the old folder aside
            aside = out.with_name(f".{out.name}.old-{os.getpid()}-{secrets.token_hex(4)}")
            with contextlib.suppress(FileNotFoundError):  # a concurrent writer moved it
                os.rename(out, aside)
            try:
                os.rename(tmp, out)
            except OSError as e:
                if e.errno not in (errno.ENOTEMPTY, errno.EEXIST):
                    raise
                continue  # another writer got in between: go round again
            finally:
                shutil.rmtree(aside, ignore_errors=True)
            return
        if swapped:
            return
        # `out` vanished between our two calls (another writer's rename-aside): go round


_AT_FDCWD, _RENAME_EXCHANGE = -100, 2


def _exchange(a: Path, b: Path) -> bool | None:
    """Swap two paths atomically: True done, False `b` is missing, None unsupported here."""
    fn = getattr(_libc(), "renameat2", None) if _libc() is not None else None
    if fn is None:
        return None
    if fn(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err == errno.ENOENT:
        return False
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
        return None
    raise OSError(err, os.strerror(err), str(b))


_LIBC: list = []


def _libc():
    if not _LIBC:
        try:
            _LIBC.append(ctypes.CDLL(None, use_errno=True))
        except OSError:
            _LIBC.append(None)
    return _LIBC[0]


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask
