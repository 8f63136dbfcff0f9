"""ftpipe importable from a bare checkout, as on the lent GPU machine: its own `python3` with
torch, transformers and the rest, nothing installed from this repository, no registry.

    from benchmarks.gpu_check import bootstrap
    bootstrap.importable(work)    # before anything imports ftpipe_runtime or the compiler

An install maps the import name `ftpipe_runtime` to the `runtime/` folder (setup.cfg's
package_dir); a checkout on PYTHONPATH has no such name. Here a folder of our own holds a
link `ftpipe_runtime -> <checkout>/runtime` and goes first on sys.path and on PYTHONPATH, so
this process and the ones it starts (pytest) import the checkout's runtime under its name.
The compiler needs nothing more (`ftpipe_compiler.resources` finds configs and templates in
the checkout). Wheels carried in `.whl/` (pymetis: `make gpu-wheels`) are installed from
there, offline, into the same folder when their package is missing.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

__all__ = ["ROOT", "importable", "missing"]

ROOT = Path(__file__).resolve().parents[2]  # the checkout
WHEELS = ROOT / ".whl"
CARRIED = ("pymetis",)  # what `make gpu-wheels` fetches; the GPU machine lacks them


def missing(*names: str) -> list[str]:
    """The modules among `names` this interpreter cannot import."""
    return [n for n in names if importlib.util.find_spec(n) is None]


def importable(site: Path) -> list[str]:
    """Make `ftpipe_runtime` (and carried wheels) importable through `site`; returns lines
    saying what was done, for the report."""
    done = []
    site.mkdir(parents=True, exist_ok=True)
    if importlib.util.find_spec("ftpipe_runtime") is None:
        link = site / "ftpipe_runtime"
        if not link.exists():
            link.symlink_to(ROOT / "runtime", target_is_directory=True)
        done.append(f"ftpipe_runtime: the checkout's runtime/ through {link}")
    else:
        where = Path(importlib.util.find_spec("ftpipe_runtime").origin).parent
        done.append(f"ftpipe_runtime: installed ({where})")
    wheels = sorted(WHEELS.glob("*.whl")) if WHEELS.is_dir() else []
    wanted = [w for w in wheels if w.name.split("-")[0].lower() in missing(*CARRIED)]
    if wanted:  # offline: --no-index, the files themselves
        subprocess.run(
            [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps",
             "--no-compile", "--target", str(site), *map(str, wanted)],
            check=True,
        )  # fmt: skip
        done.append(f"installed from .whl/ into {site}: {', '.join(w.name for w in wanted)}")
    for path in (str(site), str(ROOT)):
        if path not in sys.path:
            sys.path.insert(0, path)
    paths = [str(site), str(ROOT), os.environ.get("PYTHONPATH", "")]
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)
    importlib.invalidate_caches()
    return done
