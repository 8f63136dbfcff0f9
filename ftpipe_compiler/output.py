"""An output folder that is written whole or not at all.

with output_folder("out/t5-3b", force=False) as tmp:
    (tmp / "plan.json").write_text(...)
# out/t5-3b now holds exactly what was written; on an error nothing changed.
"""

from __future__ import annotations

import contextlib
import shutil
import tempfile
from pathlib import Path

from .errors import OutputExistsError


def check_writable(out: Path, force: bool) -> None:
    """Refuse before any work is done, so a long compile does not end in this error."""
    if out.exists() and not force and (not out.is_dir() or any(out.iterdir())):
        raise OutputExistsError(
            f"{out} already exists; pass --force to replace it, or choose another folder with -o"
        )


@contextlib.contextmanager
def output_folder(out, force: bool = False):
    out = Path(out)
    check_writable(out, force)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    # Swap only once everything is written: the old folder survives any failure above.
    old = None
    if out.exists():
        old = out.with_name(f".{out.name}.old")
        shutil.rmtree(old, ignore_errors=True)
        out.rename(old)
    tmp.rename(out)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
