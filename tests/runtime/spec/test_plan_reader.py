"""One plan reader with one set of checks (issue 33): `spec.plan.Plan.read`, which the
runtime (`read_plan`, `run`), the generated package and the compiler's `Plan.load` share.
A compiled plan reads back to itself, key for key and byte for byte; a damaged one is the
same sentence wherever it is read."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner
from ftpipe_runtime.errors import PipelineConfigError
from ftpipe_runtime.spec.plan import Plan as RuntimePlan
from ftpipe_runtime.spec.plan import read_plan

from ftpipe_compiler.cli import cli
from ftpipe_compiler.errors import PlanFormatError
from ftpipe_compiler.plan import Plan

REPO = Path(__file__).resolve().parents[3]
PACKAGE = "gpt2_tiny_pipeline"


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    out = tmp_path_factory.mktemp("compiled") / "out"
    argv = ["compile", "-m", "gpt2-tiny", "--gpus", "2", "-o", str(out), "--seed", "0"]
    r = CliRunner().invoke(cli, argv)
    assert r.exit_code == 0, r.output
    return out


def test_a_compiled_plan_reads_back_to_itself(compiled):
    text = (compiled / PACKAGE / "plan.json").read_text()
    d = json.loads(text)
    plan = RuntimePlan.from_dict(d)
    assert plan.to_dict() == d
    assert json.dumps(plan.to_dict(), indent=1) + "\n" == text  # the bytes written
    # One plan file: what `ftpipe simulate out/plan.json` reads is what the package runs.
    assert (compiled / "plan.json").read_text() == text
    # The compiler's Plan is the same record with its cost model's parts: the same JSON.
    loaded = Plan.load(compiled / "plan.json")
    assert loaded.to_dict() == d
    assert [s.offload for s in loaded.stages] == [s.offload for s in plan.stages]


def test_where_offloaded_gradients_sum_reads_back_and_defaults_to_the_host(compiled):
    """`offload.gradients`: a plan written before the field sums on the host (as it ran);
    one summing on the device reads back to itself."""
    d = json.loads((compiled / PACKAGE / "plan.json").read_text())
    d["stages"][0]["offload"] = {"optimizer": True, "activations": False}  # before the field
    d["stages"][1]["offload"] = {"optimizer": True, "activations": False, "gradients": "device"}
    plan = RuntimePlan.from_dict(d)
    assert [s.offload.gradients for s in plan.stages] == ["host", "device"]
    assert [s.offload.sums_on_device for s in plan.stages] == [False, True]
    again = RuntimePlan.from_dict(plan.to_dict())
    assert again == plan
    compiler = Plan.from_dict(plan.to_dict())  # the compiler's: its summary is its own
    assert compiler.to_dict()["stages"] == plan.to_dict()["stages"]


def test_the_runtime_reads_the_typed_plan_with_its_model_folder(compiled):
    plan = read_plan(compiled / PACKAGE / "plan.json")
    assert isinstance(plan, RuntimePlan) and plan.gpus == 2 and plan.stages[0].inputs == ()
    assert plan.transfers and all(isinstance(t.consumers, tuple) for t in plan.transfers)


def _write_damaged(folder: Path, edit) -> Path:
    d = json.loads((folder / "plan.json").read_text())
    edit(d)
    bad = folder / "bad.json"
    bad.write_text(json.dumps(d))
    return bad


def _drop_stages(d):
    d.pop("stages")


def _gpu_as_text(d):
    d["stages"][0]["gpu"] = "one"


def _future_format(d):
    d["format"] = 99


def _sends_nobody(d):
    d["stages"][1]["inputs"].append("nobody_sends_this")


def _sums_on_disk(d):
    d["stages"][0]["offload"] = {"optimizer": True, "activations": False, "gradients": "disk"}


def _step_tomorrow(d):
    d["stages"][0]["offload"] = {"optimizer": True, "step": "tomorrow"}


DAMAGE = [
    (_sums_on_disk, r"stage 0 sums its offloaded gradients on 'disk', not one of host, device"),
    (_step_tomorrow, r"stage 0 lands its offloaded step 'tomorrow', not one of exact, lagged"),
    (_drop_stages, r"incomplete or damaged \(KeyError: 'stages'\)"),
    (_gpu_as_text, r"Stage field 'gpu' cannot be 'one'"),
    (_future_format, r"plan format 99 was written by"),
    (_sends_nobody, r"stage 1 receives 'nobody_sends_this', which nobody sends"),
]


@pytest.mark.parametrize("edit, words", DAMAGE, ids=lambda x: getattr(x, "__name__", ""))
def test_a_damaged_plan_is_the_same_sentence_everywhere(compiled, tmp_path, edit, words):
    bad = _write_damaged(compiled, edit)
    with pytest.raises(PipelineConfigError) as runtime:
        read_plan(bad)
    with pytest.raises(PlanFormatError) as compiler:
        Plan.load(bad)
    sentence = str(runtime.value)
    assert re.search(words, sentence) and sentence.startswith(f"{bad} is not a valid plan: ")
    assert str(compiler.value) == sentence
    r = CliRunner().invoke(cli, ["simulate", str(bad)])
    assert r.exit_code == 1 and sentence in r.output, r.output


@pytest.mark.slow
def test_a_package_with_a_damaged_plan_says_the_same(compiled, tmp_path):
    """`python -m pkg` (its own process, the package's reader) and `ftpipe simulate`."""
    import shutil

    pkg = tmp_path / PACKAGE
    shutil.copytree(compiled / PACKAGE, pkg)
    bad = _write_damaged(pkg, _gpu_as_text)
    os.replace(bad, pkg / "plan.json")
    env = {**os.environ, "PYTHONPATH": str(REPO), "CUDA_VISIBLE_DEVICES": "", "RANK": "0"}
    for argv in ([], ["--check"]):
        r = subprocess.run([sys.executable, "-m", PACKAGE, *argv], cwd=tmp_path, env=env,
                           capture_output=True, text=True, timeout=300)  # fmt: skip
        assert r.returncode == 1, r.stderr
        lines = r.stderr.strip().splitlines()
        assert len(lines) == 1 and "Stage field 'gpu' cannot be 'one'" in lines[0], r.stderr
        assert f"{pkg / 'plan.json'} is not a valid plan: " in lines[0]
    with pytest.raises(PlanFormatError, match=re.escape(lines[0].removeprefix("ftpipe: "))):
        Plan.load(pkg / "plan.json")


def test_only_the_reader_parses_plan_files():
    """No other module opens a plan.json and parses it: they go through `Plan.read`."""
    readers = []
    for root in ("runtime", "ftpipe_compiler", "templates"):
        for f in (REPO / root).rglob("*"):
            if f.suffix not in (".py", ".j2") or not f.is_file():
                continue
            text = f.read_text()
            if re.search(r"json\.loads?\(", text) and "plan" in text.lower():
                for line in text.splitlines():
                    if re.search(r"json\.loads?\([^)]*plan", line, re.IGNORECASE):
                        readers.append(f"{f.relative_to(REPO)}: {line.strip()}")
    assert readers == [], readers
    # Topology reads no file and checks nothing of its own: the plan's checks are its checks.
    topology = (REPO / "runtime" / "spec" / "topology.py").read_text()
    assert "def read_plan" not in topology and 'raise PipelineConfigError("the plan' not in topology
