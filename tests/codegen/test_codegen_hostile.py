"""Names from outside never run as code: a package generated from hostile names (a command
line, an output path, a model folder's name and path, module and parameter names holding
newlines, quotes, triple quotes, `{{ }}`, `../`, backslashes and the characters other tools
split lines at) imports without running any of them, and says them back as they were."""

from __future__ import annotations

import ast
import dataclasses
import json
import shlex
import subprocess
import sys

import pytest
import torch
from click.testing import CliRunner
from codegen_helpers import REPO, contiguous
from ftpipe_runtime.job.check import synthetic_inputs
from safetensors.torch import save_file
from torch import nn

from ftpipe_compiler.cli import cli
from ftpipe_compiler.codegen import generate_package
from ftpipe_compiler.codegen.source import identifier, literal, text
from ftpipe_compiler.costs.profilers import costed_graph

# Each would create the file PWN in the working folder if it ran as code.
RUN = 'open("PWN", "w")'
HOSTILE = [
    f"a\n{RUN}\n#",  # ends a comment
    f'b"""\n{RUN}\n"""',  # ends a docstring
    f"c\r{RUN}\r#",  # a carriage return ends a comment too
    "d\\",  # a trailing backslash would swallow the closing quote
    "e{{ 7 * 7 }}{% if 1 %}",  # template syntax stays text
    "f\u2028g\u2029h\x0bi\x0cj\x1ck\x85l",  # line ends for str.splitlines, not for Python
    "m'\"n",  # both quotes
    "o\x00p",  # NUL: no Python file may hold one
    "q\udcff",  # a lone surrogate (an undecodable byte of a file name)
    "../../r",  # a path up
    "\\N{BULLET} \\x41 \\u0041",  # escapes that must not be interpreted
]
# Module names cannot hold a dot or NUL (nn.Module.add_module), nor a surrogate (safetensors
# stores names as UTF-8); every other case is one.
MODULE_NAMES = [h for h in HOSTILE if "." not in h and "\x00" not in h and "\udcff" not in h]


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        return torch.relu(self.lin(x))


class HostileNames(nn.Module):
    """A block under every hostile module name: they reach the stages' comments, docstrings,
    PARAMS and `get_parameter` calls."""

    def __init__(self):
        super().__init__()
        for name in MODULE_NAMES:
            self.add_module(name, Block())

    def forward(self, x):
        for name in MODULE_NAMES:
            x = getattr(self, name)(x)
        return x.square().mean()


def hostile_model():
    torch.manual_seed(0)
    return HostileNames(), (torch.randn(4, 8),)


@pytest.mark.parametrize("value", HOSTILE)
def test_escapes_give_back_the_value_on_one_line(value):
    code = literal(value)
    assert ast.literal_eval(code) == value and len(code.splitlines()) == 1
    said = text(value)
    assert len(said.splitlines()) == 1 and "\x00" not in said
    assert ast.literal_eval(f'"""{said}"""') == value  # in a docstring: the value itself
    tree = ast.parse(f"# {said}\nx = 1\n")  # in a comment: nothing but the comment
    assert [type(n).__name__ for n in tree.body] == ["Assign"]
    name = identifier(value)
    assert name.isidentifier() and name.isascii()


def test_every_unprintable_character_is_escaped():
    odd = "".join(chr(c) for c in range(0x30000) if not chr(c).isprintable())
    assert ast.literal_eval(literal(odd)) == odd
    assert all(c.isprintable() for c in text(odd))


def _import(pkg_parent, name, cwd):
    """Import the package and its modules in a fresh interpreter, construct and run its
    stages on the plan's synthetic inputs; returns its docstring and the loss."""
    code = (
        f"import importlib, sys; sys.path.insert(0, {str(pkg_parent)!r}); "
        f"pkg = importlib.import_module({name!r}); importlib.import_module({name + '.__main__'!r}); "
        "from ftpipe_runtime.job.check import synthetic_inputs; "
        "from ftpipe_runtime.stage.api import run_in_one_process; "
        "stages = {k: c() for k, c in pkg.STAGES.items()}; "
        "loss = run_in_one_process(stages, pkg.load_plan(), synthetic_inputs(pkg.load_plan())); "
        "print(repr(pkg.__doc__)); print(repr(float(loss)))"
    )
    env = {"PYTHONPATH": str(REPO), "CUDA_VISIBLE_DEVICES": "", "PATH": ""}
    run = subprocess.run(
        [sys.executable, "-c", code], cwd=cwd, env=env, capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 0, run.stderr[-3000:]
    doc, loss = run.stdout.splitlines()[-2:]
    return ast.literal_eval(doc), float(loss)


def test_a_package_of_hostile_names_imports_without_running_them(tmp_path):
    """The model's module names, its folder's name and path and the command line, all hostile."""
    spec, _, traced, graph = costed_graph("test_codegen_hostile:hostile_model")
    folder = tmp_path / "models" / HOSTILE[0]  # a folder of any name, holding the weights
    folder.mkdir(parents=True)
    model, _ = hostile_model()
    save_file(model.state_dict(), folder / "model.safetensors")
    name = " ".join(HOSTILE)
    spec = dataclasses.replace(spec, name=name, path=str(folder))
    out = tmp_path / "out"
    pkg = generate_package(traced, graph, contiguous(graph, 2), spec, out, command=name)
    assert pkg.name.isidentifier() and pkg.name.isascii() and pkg.parent == out
    for f in ("__init__.py", "__main__.py", "stages.py", "README.md"):
        head = (pkg / f).read_text().splitlines()
        assert head[0].startswith(("# Generated by", "<!-- Generated by")) and head[1] != RUN
    doc, loss = _import(out, pkg.name, tmp_path)
    assert doc.startswith(f"{name} as a 2-stage pipeline")  # said back exactly
    inputs = synthetic_inputs(json.loads((pkg / "plan.json").read_text()))
    assert loss == pytest.approx(model(*inputs.values()).item(), rel=1e-5)  # the folder's weights
    assert not list(tmp_path.rglob("PWN"))
    stages = (pkg / "stages.py").read_text()
    assert (
        f"WEIGHTS_DIR = str(Path(__file__).parent / {literal('../../models/' + HOSTILE[0])})"
        in stages
    )
    assert all(literal(f"{m}.lin.weight") in stages for m in MODULE_NAMES)


def test_compile_with_a_hostile_output_path(tmp_path, monkeypatch):
    """The issue's case: `-o` holding a newline and code, through the command line."""
    monkeypatch.chdir(tmp_path)
    out = f"o\n{RUN}\n#"
    argv = ["compile", "-m", "test_codegen_hostile:hostile_model", "-g", "2",
            "--schedule", "gpipe", "-p", "even-layers", "-o", out]  # fmt: skip
    r = CliRunner().invoke(cli, argv)
    assert r.exit_code == 0, r.output
    pkg = tmp_path / out / "test_codegen_hostile_pipeline"
    assert (pkg / "__init__.py").read_text().startswith("# Generated by")
    _import(pkg.parent, pkg.name, tmp_path)
    assert not list(tmp_path.rglob("PWN"))
    assert f"run it: cd {shlex.quote(out)} && torchrun" in r.output  # pasted back: that folder


@pytest.mark.parametrize("model", ["..", "../x", "a/../..", "\n", ".hidden"])
def test_default_output_folder_stays_in_out(model):
    from ftpipe_compiler.cli.compile import _folder_name

    name = _folder_name(model)
    assert name not in ("", ".", "..") and "/" not in name and name.isprintable()
