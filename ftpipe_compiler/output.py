"""An output folder that is written whole or not at all.

with output_folder("out/t5-3b", force=False) as tmp:
    write_atomic(tmp / "plan.json", ...)
# out/t5-3b now holds exactly what was written; on any error nothing changed and no
# temporary folder is left behind. A failed write (a full disk) is a WriteFailed naming
# out/t5-3b, said in one line by the command line.

The finished folder replaces the old one in one step (`ftpipe_runtime.atomic.new_folder`:
`renameat2(RENAME_EXCHANGE)`, so `out` never stops existing). Concurrent `--force` writers each
swap in their own complete folder: the last one wins and none of them leaves debris.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path

from ftpipe_runtime.atomic import new_folder

from .errors import FtpipeError, OutputExistsError

__all__ = ["check_writable", "output_folder"]


def check_writable(out, force: bool) -> None:
    """Refuse before any work is done, so a long compile does not end in this error."""
    out = Path(out)
    here = Path.cwd().resolve()
    try:
        resolved = out.resolve()
    except (OSError, RuntimeError) as e:  # RuntimeError: a symlink loop (Python 3.11)
        raise FtpipeError(f"cannot write {out}: {e}; choose another folder with -o") from None
    if resolved == here or resolved in here.parents:
        raise OutputExistsError(
            f"{out} is the folder you are in (or holds it); choose another folder with -o"
        )
    if out.exists() and not out.is_dir():
        raise OutputExistsError(f"{out} exists and is not a folder; choose another folder with -o")
    if out.exists() and not force and any(out.iterdir()):
        raise OutputExistsError(
            f"{out} already exists; pass --force to replace it, or choose another folder with -o"
        )
    parent = resolved.parent
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
def output_folder(out, force: bool = False, needs: int | None = None):
    """`needs`: the bytes it will hold, when known (said when the disk is full)."""
    out = Path(out)
    check_writable(out, force)
    with new_folder(
        out, force, FtpipeError, "; choose another folder with -o", exists=_appeared, needs=needs
    ) as tmp:
        yield tmp


def _appeared(out: Path) -> OutputExistsError:
    return OutputExistsError(
        f"{out} appeared while compiling; pass --force to replace it, or choose another folder"
    )
