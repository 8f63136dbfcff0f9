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
import fnmatch
import os
import tempfile
from pathlib import Path

from ftpipe_runtime.atomic import new_folder, overlap

from .errors import FtpipeError, OutputExistsError

__all__ = ["COMPILED", "check_apart", "check_writable", "output_folder"]

# What `ftpipe compile` writes in its folder: anything else there (the model, the data, a
# run's checkpoints, the user's notes) would go with the folder --force replaces.
COMPILED = ("plan.json", "report.html", "*_pipeline/")


def check_writable(out, force: bool, inputs: dict | None = None, written=None) -> None:
    """Refuse before any work is done, so a long compile does not end in this error.

    `inputs`: what the command reads ({"the model folder": path}, see `check_apart`);
    `written`: the names the command writes in `out` (patterns, a folder's ending in /), when
    a folder holding anything else must not be replaced."""
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
    # A new folder inside the model folder changes none of its files (`cd model && ftpipe
    # compile -m .` writes ./out); replacing one that holds them would delete them.
    check_apart(out, inputs or {}, "choose another folder with -o", inside_ok=True)
    if out.exists() and not out.is_dir():
        raise OutputExistsError(f"{out} exists and is not a folder; choose another folder with -o")
    if written is not None and out.is_dir():
        # Said with or without --force: "pass --force" would only lead to this refusal.
        foreign = sorted(p.name for p in out.iterdir() if not _written(p, written))
        if foreign:
            raise OutputExistsError(
                f"{out} holds files ftpipe compile does not write ({', '.join(foreign[:3])}"
                f"{', ...' if len(foreign) > 3 else ''}), which replacing it would delete; "
                "move them, or choose another folder with -o"
            )
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


def check_apart(
    out, inputs: dict, hint: str, name: str | None = None, inside_ok: bool = False
) -> None:
    """Refuse an output that is one of the command's inputs, holds one (replacing the folder
    would delete it) or, unless `inside_ok`, lies inside an input folder (writing it would
    change the input).

    `inputs`: {"the model folder": path, "--data": path, ...}; those that do not exist are
    left to the command's own error. `name`: the output as the message says it ("the
    report r.html"; default its path); `hint`: what to do instead."""
    met = overlap(out, inputs, inside=not inside_ok)
    if met is None:
        return
    how, what, given = met
    name, said = name or str(out), f"{what} {given}"
    if how == "is":
        raise FtpipeError(f"{name} is {said}, which this command reads; {hint}")
    if how == "holds":
        raise FtpipeError(
            f"{name} holds {said}, which this command reads and replacing {out} would delete; "
            f"{hint}"
        )
    raise FtpipeError(
        f"{name} is inside {said}, which this command reads and must not change; {hint}"
    )


def _written(entry: Path, patterns) -> bool:
    """`entry` matches one of `patterns`: a file's name, or a folder's with a trailing /."""
    for pattern in patterns:
        folder = pattern.endswith("/")
        if folder == entry.is_dir() and fnmatch.fnmatchcase(entry.name, pattern.rstrip("/")):
            return True
    return False


@contextlib.contextmanager
def output_folder(
    out, force: bool = False, needs: int | None = None, inputs: dict | None = None, written=None
):
    """`needs`: the bytes it will hold, when known (said when the disk is full); `inputs` and
    `written`: as `check_writable`'s."""
    out = Path(out)
    check_writable(out, force, inputs, written)
    with new_folder(
        out, force, FtpipeError, "; choose another folder with -o", exists=_appeared, needs=needs
    ) as tmp:
        yield tmp


def _appeared(out: Path) -> OutputExistsError:
    return OutputExistsError(
        f"{out} appeared while compiling; pass --force to replace it, or choose another folder"
    )
