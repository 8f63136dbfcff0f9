"""Code generation: render a Plan into a standalone pipeline package.

    pkg = generate_package(traced, graph, plan, spec, Path("out"), command="ftpipe compile ...")
    result = check_package(pkg)     # stages chained in one process vs the original model
    assert result.ok, result

The package (`out/<model>_pipeline/`) holds `stages.py` (one nn.Module per stage, straight-line
ATen code, parameters under their original names), `plan.json` (what the runtime executes),
`__init__.py` (STAGES, load_plan), `__main__.py` (torchrun entry point and `--check`, whose
logic is the runtime's `ftpipe_runtime.check`) and a README.
"""

from __future__ import annotations

import importlib.util
import itertools
import sys
from pathlib import Path

from .package import generate_package

__all__ = ["generate_package", "check_package", "import_package"]

_loaded = itertools.count()


def import_package(pkg_dir) -> object:
    """Import a generated package from its folder under a unique module name, so that several
    packages of the same name (one per test, say) can live in one process."""
    pkg_dir = Path(pkg_dir).resolve()
    name = f"_ftpipe_generated_{next(_loaded)}_{pkg_dir.name}"
    spec = importlib.util.spec_from_file_location(
        name, pkg_dir / "__init__.py", submodule_search_locations=[str(pkg_dir)]
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def check_package(pkg_dir, seed: int = 0):
    """Run the package's own check (`python -m <pkg> --check`) and return its CheckResult."""
    from ftpipe_runtime.check import check

    module = import_package(pkg_dir)
    return check(module.STAGES, module.load_plan(), seed)
