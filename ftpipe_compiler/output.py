"""An output folder that is written whole or not at all.

with output_folder("out/t5-3b", force=False) as tmp:
    write_atomic(tmp / "plan.json", ...)
# out/t5-3b now holds exactly what was written; on any error nothing changed and no
# temporary folder is left behind.

The finished folder replaces the old one in one step: on Linux `renameat2(RENAME_EXCHANGE)`
swaps the two, so `out` never stops existing; where that call is missing the old folder is
renamed aside first (a window of one rename). Concurrent `--force` writers each swap in their
own complete folder: the last one wins and none of them leaves a `.out.xxxx` folder.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import secrets
import shutil
import tempfile
from pathlib import Path

from .errors import FtpipeError, OutputExistsError

__all__ = ["check_writable", "output_folder"]


def check_writable(out, force: bool) -> None:
    """Refuse before any work is done, so a long compile does not end in this error."""
    out = Path(out)
    here = Path.cwd().resolve()
    if out.resolve() == here or out.resolve() in here.parents:
        raise OutputExistsError(
            f"{out} is the folder you are in (or holds it); choose another folder with -o"
        )
    if out.exists() and not out.is_dir():
        raise OutputExistsError(f"{out} exists and is not a folder; choose another folder with -o")
    if out.exists() and not force and any(out.iterdir()):
        raise OutputExistsError(
            f"{out} already exists; pass --force to replace it, or choose another folder with -o"
        )
    parent = out.resolve().parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        raise FtpipeError(f"cannot write {out}: {parent} is a file; choose another folder with -o")
    try:
        os.rmdir(tempfile.mkdtemp(prefix=f".{out.name}.probe-", dir=parent))
    except OSError as e:
        raise FtpipeError(
            f"cannot write {out}: {e.strerror} ({parent}); choose another folder with -o"
        ) from None


@contextlib.contextmanager
def output_folder(out, force: bool = False):
    out = Path(out)
    check_writable(out, force)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    except OSError as e:
        raise FtpipeError(f"cannot write {out}: {e.strerror}; choose another folder with -o") from e
    try:
        os.chmod(tmp, 0o777 & ~_umask())  # mkdtemp makes 0700; an output folder is ordinary
        yield tmp
        try:
            _swap_in(tmp, out, force)
        except OSError as e:
            raise FtpipeError(f"cannot put {out} in place: {e.strerror}; nothing changed") from e
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # the old folder after a swap, or our leftovers


def _swap_in(tmp: Path, out: Path, force: bool) -> None:
    """Put `tmp` at `out`; afterwards `tmp` holds the replaced folder, if there was one."""
    while True:
        try:
            os.rename(tmp, out)  # out missing or empty: done in one step
            return
        except OSError as e:
            if e.errno not in (errno.ENOTEMPTY, errno.EEXIST):
                raise
        if not force:  # another writer filled `out` since check_writable
            raise OutputExistsError(
                f"{out} appeared while compiling; pass --force to replace it, or choose another folder"
            )
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
