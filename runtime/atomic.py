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
`remove_temporaries` clears those.

This is the one place where a failed write becomes a sentence (`WriteFailed`, or the
caller's error for a folder): what could not be written, why, and for a full disk how much
space there is and is needed and what to do. Libraries hide the OSError of a full disk
(`torch.save` raises `RuntimeError: [enforce fail ...] unexpected pos`, safetensors a
`SafetensorError` "... (os error 28)"): the file handed out remembers the failed write, and
`write_failure` finds it behind whatever was raised.

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
    "failure_reason",
    "file_in_the_way",
    "new_folder",
    "overlap",
    "remove_temporaries",
    "swap_folder",
    "temporary_folder",
    "write_atomic",
    "write_failure",
]

TEMPORARY = re.compile(r"^\..+\.\d+-[0-9a-f]{8}\.tmp$")
FULL = (errno.ENOSPC, errno.EDQUOT)  # the disk, or the user's quota on it, is full
# Errors of the storage itself: a block that fails with one of these failed to write.
STORAGE = (*FULL, errno.EFBIG, errno.EROFS, errno.EIO)
_RUST_OS_ERROR = re.compile(r"\(os error (\d+)\)")  # how safetensors (Rust) reports one


def write_failure(exc: BaseException) -> OSError | None:
    """The failed write behind `exc`, or None: a `WriteFailed`, or an OSError of the storage
    (full, read-only, too large, I/O) raised or chained (torch.save's RuntimeError holds it
    as its context), or one a library reports only in words (safetensors)."""
    seen = set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, WriteFailed):
            return e.__cause__ if isinstance(e.__cause__, OSError) else e
        if isinstance(e, OSError) and e.errno in STORAGE:
            return e
        found = _RUST_OS_ERROR.search(str(e)) if not isinstance(e, OSError) else None
        if found and int(found[1]) in STORAGE:
            code = int(found[1])
            return OSError(code, os.strerror(code))
        e = e.__cause__ or (None if e.__suppress_context__ else e.__context__)
    return None


def failure_reason(err: OSError, where, needs: int | None = None, at_least: bool = False) -> str:
    """Why a write to `where` failed, and for a full disk the space free there and `needs`
    (bytes; `at_least`: what was written before it failed) and what to do."""
    if err.errno not in FULL:
        return str(err.strerror or err)
    from .job.report import human_bytes  # (torch-heavy: only when a disk is full)

    free = _free_bytes(Path(where))
    space = [f"{human_bytes(free)} free there"] if free is not None else []
    if needs:
        space.append(f"{'at least ' if at_least else ''}{human_bytes(needs)} needed")
    said = f" ({', '.join(space)})" if space else ""
    return f"{err.strerror}{said}; free some space or write elsewhere"


def _free_bytes(path: Path) -> int | None:
    while not path.exists() and path != path.parent:
        path = path.parent
    try:
        return shutil.disk_usage(path).free
    except OSError:
        return None


class _Watched:
    """The file `atomic_open` hands out: it counts what is written and remembers a failed
    write, whatever the caller turns it into."""

    def __init__(self, f):
        self._f, self.written, self.failure = f, 0, None

    def write(self, data):
        try:
            n = self._f.write(data)
        except OSError as e:
            self.failure, self.written = e, self.written + len(data)
            raise
        self.written += len(data)
        return n

    def __getattr__(self, name):
        return getattr(self._f, name)


def _temporary(path: Path) -> Path:
    return path.with_name(f".{path.name}.{os.getpid()}-{secrets.token_hex(4)}.tmp")


@contextlib.contextmanager
def atomic_open(path, mode: str = "w", encoding: str = "utf-8", needs: int | None = None):
    """A file object for `path` ("w" text or "wb" bytes) that replaces it only on success.
    `needs`: its size when known (said when the disk is full)."""
    if mode not in ("w", "wb"):
        raise ValueError(f"atomic_open writes whole files: mode 'w' or 'wb', not {mode!r}")
    path = Path(path)
    tmp = _temporary(path)
    watched = None
    try:
        with open(tmp, mode.replace("w", "x"), encoding=None if "b" in mode else encoding) as f:
            watched = _Watched(f)
            yield watched
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as e:
        with contextlib.suppress(OSError):
            tmp.unlink()
        if isinstance(e, WriteFailed):
            raise
        if not isinstance(e, Exception):  # Ctrl-C, exit: not a failed write
            raise
        err = e if isinstance(e, OSError) else getattr(watched, "failure", None)
        if err is None:
            raise
        kept = "the previous file is unchanged" if path.exists() else "nothing was written"
        written = getattr(watched, "written", 0)
        why = failure_reason(err, path.parent, needs or written, at_least=not needs)
        raise WriteFailed(f"cannot write {path}: {why}; {kept}") from err
    _sync_folder(path.parent)


def write_atomic(path, data: str | bytes) -> None:
    """Replace `path` with `data` atomically."""
    size = len(data) if isinstance(data, bytes) else len(data.encode())
    with atomic_open(path, "wb" if isinstance(data, bytes) else "w", needs=size) as f:
        f.write(data)


def file_in_the_way(path) -> Path | None:
    """The nearest existing ancestor of `path` (or `path` itself) when it is a file: no folder
    can be made there. None when that ancestor is a folder, or nothing exists."""
    path = Path(path)
    up = next((p for p in (path, *path.parents) if p.exists()), None)
    return up if up is not None and not up.is_dir() else None


def overlap(out, inputs: dict, inside: bool = True) -> tuple[str, str, object] | None:
    """How an output meets what the command reads, for a caller to phrase: (how, what, path)
    for the first input it meets, `how` one of "is" (the same file or folder, also under two
    names: a hard link, a bind mount), "holds" (the input lies inside the output, which
    replacing would delete) and, with `inside`, "inside" (the output lies inside an input
    folder); None when apart. `inputs`: {what: path}; paths that do not exist or cannot be
    resolved are skipped (the command's own error says why).

        overlap("out", {"the model folder": "out/model"})  # ("holds", "the model folder", ...)
    """
    target = _resolved(out)
    if target is None:
        return None
    for what, given in inputs.items():
        if given is None or not os.path.lexists(given):
            continue
        source = _resolved(given)
        if source is None:
            continue
        if source == target or _same_file(out, given):
            return "is", what, given
        if target in source.parents:
            return "holds", what, given
        if inside and source in target.parents and source.is_dir():
            return "inside", what, given
    return None


def _resolved(path) -> Path | None:
    try:
        return Path(path).resolve()
    except (OSError, RuntimeError):  # RuntimeError: a symlink loop (Python 3.11)
        return None


def _same_file(a, b) -> bool:
    """One file under two names Path.resolve does not join (a hard link, a bind mount, a
    case-insensitive file system)."""
    try:
        return os.path.samefile(a, b)
    except OSError:  # one of them does not exist
        return False


def check_writable_file(path, what: str = "") -> None:
    """Raise WriteFailed now, before the work, if `path` could not be written at the end.
    `what` names the file in the message ("the report")."""
    path = Path(path)
    name = f"{what} {path}" if what else str(path)
    if path.is_dir():
        raise WriteFailed(f"cannot write {name}: it is a folder; give a file name")
    folder = path.parent
    if not folder.is_dir():
        if (up := file_in_the_way(folder)) is not None:
            raise WriteFailed(f"cannot write {name}: {up} is a file, not a folder")
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
def new_folder(
    out, replace: bool = True, error=WriteFailed, hint: str = "", exists=None, needs=None
):
    """A temporary folder beside `out`, put in its place whole when the block succeeds.

    `error(message)` is raised when the folder cannot be made (message + `hint`) or put in
    place (nothing changed), a WriteFailed naming `out` when a write of the block failed
    (`write_failure`; `needs`, the bytes the folder takes when known, is said for a full
    disk); `exists(out)` (default FileExistsError) when `replace` is False and another writer
    filled `out` meanwhile. Other errors of the block pass unchanged."""
    out = Path(out)
    try:
        tmp = temporary_folder(out)
    except OSError as e:
        raise error(f"cannot write {out}: {failure_reason(e, out.parent, needs)}{hint}") from e
    try:
        try:
            yield tmp
        except Exception as e:
            err = write_failure(e)
            if err is None:
                raise
            why = failure_reason(err, out.parent, needs)
            raise WriteFailed(f"cannot write {out}: {why}; nothing changed{hint}") from err
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
