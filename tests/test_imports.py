"""Every module imports on its own (no cycle that only works in one import order), no compiler
module imports another of the compiler inside a function (the way a cycle gets dodged),
setup.py finds every package, and the runtime never imports the compiler."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SOURCES = {"ftpipe_compiler": ROOT / "ftpipe_compiler", "ftpipe_runtime": ROOT / "runtime"}

# One interpreter (torch loads once); before each module every ftpipe module is dropped from
# sys.modules, so each import starts from nothing of ours, as in a fresh interpreter.
_PROBE = """
import importlib, json, sys, traceback
out = {}
for name in json.loads(sys.argv[1]):
    for m in [m for m in sys.modules if m.split(".")[0] in ("ftpipe_compiler", "ftpipe_runtime")]:
        del sys.modules[m]
    try:
        importlib.import_module(name)
    except Exception:
        out[name] = traceback.format_exc(limit=-3)
        continue
    if name.startswith("ftpipe_runtime") and "ftpipe_compiler" in sys.modules:
        out[name] = "imports ftpipe_compiler"
print(json.dumps(out))
"""


def _packages(top: str, folder: Path) -> list[str]:
    return [
        ".".join([top, *p.parent.relative_to(folder).parts])
        for p in sorted(folder.rglob("__init__.py"))
        if "__pycache__" not in p.parts
    ]


def _modules() -> list[str]:
    names = []
    for top, folder in SOURCES.items():
        for p in sorted(folder.rglob("*.py")):
            parts = p.relative_to(folder).with_suffix("").parts
            if "__pycache__" in parts or parts[-1] == "__main__":  # __main__ runs the CLI
                continue
            parts = parts[:-1] if parts[-1] == "__init__" else parts
            names.append(".".join([top, *parts]))
    return names


def test_every_module_imports_alone_and_the_runtime_never_imports_the_compiler():
    modules = _modules()
    assert len(modules) > 50
    got = subprocess.run(
        [sys.executable, "-c", _PROBE, json.dumps(modules)],
        capture_output=True,
        text=True,
        check=True,
        cwd=ROOT,
    )
    failed = json.loads(got.stdout.strip().splitlines()[-1])
    assert failed == {}, "\n".join(f"{k}:\n{v}" for k, v in failed.items())


def test_setup_py_finds_every_package():
    sys.path.insert(0, str(ROOT))
    try:
        from setup import packages
    finally:
        sys.path.remove(str(ROOT))
    found = set()
    for top, folder in SOURCES.items():
        found.update(_packages(top, folder))
    assert found <= set(packages()), "packages setup.py misses"


def test_the_compiler_imports_its_own_modules_at_the_top():
    """Late imports remain only for optional extras (transformers, peft, safetensors) and the
    runtime (which never imports the compiler, so no cycle runs through it)."""
    late = []
    for path in sorted(SOURCES["ftpipe_compiler"].rglob("*.py")):
        tree = ast.parse(path.read_text())
        for fn in ast.walk(tree):
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for node in ast.walk(fn):
                own = (isinstance(node, ast.ImportFrom) and (node.level > 0 or (node.module or "")
                       .startswith("ftpipe_compiler"))) or (isinstance(node, ast.Import) and any(
                       a.name.startswith("ftpipe_compiler") for a in node.names))  # fmt: skip
                if own:
                    late.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert late == []


def test_importing_the_runtime_defines_no_op_and_sets_nothing():
    """No runtime module is imported for its side effects: importing every one leaves torch's
    op registry and the process's allocator settings as they were (the stage base class,
    the compiler's fusion and the package entry point do that explicitly)."""
    probe = """
import importlib, os, pkgutil, torch, ftpipe_runtime
before = dict(os.environ)
for m in pkgutil.walk_packages(ftpipe_runtime.__path__, "ftpipe_runtime."):
    importlib.import_module(m.name)
assert not torch._C._dispatch_has_kernel("ftpipe::linear_cross_entropy"), "an op defined"
assert dict(os.environ) == before, "the environment changed"
from ftpipe_runtime.stage import fused_loss
fused_loss.register()
fused_loss.register()  # (once)
assert torch._C._dispatch_has_kernel("ftpipe::linear_cross_entropy")
print("ok")
"""
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]
