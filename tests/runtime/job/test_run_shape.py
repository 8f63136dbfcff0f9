"""The run's state crosses modules typed: `train._Run` (the orchestration of one plan's
phases) stays in train.py, and the functions of other modules take the run's contexts
(`job.context`) or the few values they need, never the whole run; and the command lines
are read as typed records (`job.config`): no argparse namespace is read anywhere else."""

from __future__ import annotations

import ast
import re
from pathlib import Path

RUNTIME = Path(__file__).resolve().parents[3] / "runtime"
TRAIN = RUNTIME / "job" / "train.py"
CONFIG = RUNTIME / "job" / "config.py"
# Where command lines are parsed: the records' module, and the run's parser (`options`).
PARSERS = {CONFIG, RUNTIME / "job" / "options.py"}


def _modules():
    for path in sorted(RUNTIME.rglob("*.py")):
        if "__pycache__" not in path.parts:
            yield path, ast.parse(path.read_text(), filename=str(path))


def _where(path: Path, node: ast.AST) -> str:
    return f"{path.relative_to(RUNTIME.parent)}:{node.lineno}"


def test_the_run_object_stays_in_train_py():
    found = [
        f"{path.relative_to(RUNTIME.parent)}:{n}"
        for path, _ in _modules()
        if path != TRAIN
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if re.search(r"\b_Run\b", line)
    ]
    assert found == [], "_Run named outside train.py"


def test_no_function_elsewhere_takes_the_whole_run():
    """A parameter called `run` of a function outside train.py is the untyped bag: refused
    unless its annotation says what it is (and that is not `_Run`). Lambdas are left alone:
    `key=lambda run: ...` is local and takes what its caller hands it."""
    found = []
    for path, tree in _modules():
        if path == TRAIN:
            continue
        for node in ast.walk(tree):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            a = node.args
            for arg in [*a.posonlyargs, *a.args, *a.kwonlyargs]:
                if arg.arg == "run" and (
                    arg.annotation is None or "_Run" in ast.unparse(arg.annotation)
                ):
                    found.append(_where(path, node))
    assert found == [], "functions taking the run whole"


def test_no_argparse_namespace_is_read_outside_the_config_module():
    reads, parses = [], []
    for path, tree in _modules():
        for node in ast.walk(tree):
            if (
                path != CONFIG
                and isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Name)
                and node.value.id == "args"
            ):
                reads.append(f"{_where(path, node)} args.{node.attr}")
            if (
                path not in PARSERS
                and isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr in ("parse_args", "parse_known_args", "parse_intermixed_args")
            ):
                parses.append(_where(path, node))
    assert reads == [], "argparse namespaces read outside job/config.py"
    assert parses == [], "command lines parsed outside job/config.py and job/options.py"
