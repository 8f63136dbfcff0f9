"""Code generation: render a Plan into a standalone pipeline package.

    pkg = generate_package(traced, graph, plan, spec, Path("out"), command="ftpipe compile ...")
    result = check_package(pkg)     # stages chained in one process vs the original model
    assert result.ok, result

The package (`out/<model>_pipeline/`) holds `stages.py` (one nn.Module per stage, straight-line
ATen code, parameters under their original names), `plan.json` (what the runtime executes),
`__init__.py` (STAGES, load_plan), `__main__.py` (torchrun entry point and `--check`, whose
logic is the runtime's `ftpipe_runtime.job.check`) and a README.
"""

from __future__ import annotations

from ftpipe_runtime.stage.package import import_package

from .package import generate_package

__all__ = ["generate_package", "check_package", "import_package"]


def check_package(pkg_dir, seed: int = 0):
    """Run the package's own check (`python -m <pkg> --check`) and return its CheckResult."""
    from ftpipe_runtime.job.check import check

    module = import_package(pkg_dir)
    return check(module.STAGES, module.load_plan(), seed)
