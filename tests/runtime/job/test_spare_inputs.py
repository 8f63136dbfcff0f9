"""A run's outputs never replace its inputs (`ftpipe_runtime.job.spare_inputs`): the bad-input
audit's cases, each once refused and once a path beside them that is allowed."""

from __future__ import annotations

import sys
import types

import pytest
from ftpipe_runtime.errors import PipelineConfigError
from ftpipe_runtime.job.config import RunConfig
from ftpipe_runtime.job.spare_inputs import check_outputs_spare_inputs


@pytest.fixture
def package(tmp_path, monkeypatch):
    """A package folder (plan.json beside its stages module), the model's folder beside it
    (as `compile` records it: relative to the package), a data file and a tokenizer folder."""
    pkg = tmp_path / "out" / "m_pipeline"
    pkg.mkdir(parents=True)
    (pkg / "plan.json").write_text("{}")
    (pkg / "stages.py").write_text("")
    model = tmp_path / "m"
    model.mkdir()
    for name in ("config.json", "model.safetensors", "tokenizer.json"):
        (model / name).write_text("x")
    (tmp_path / "train.jsonl").write_text("[1, 2]\n")
    module = types.ModuleType("m_pipeline_stages_for_test")
    module.__file__ = str(pkg / "stages.py")
    monkeypatch.setitem(sys.modules, module.__name__, module)
    stage = type("Stage0", (), {"__module__": module.__name__})
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("FTPIPE_WEIGHTS", raising=False)
    return {"plan": {"model": {"path": "../../m"}}, "stages": {0: stage}}


def _check(package, **options):
    check_outputs_spare_inputs(RunConfig(**options), package["plan"], package["stages"])


@pytest.mark.parametrize(
    "options, said",
    [
        ({"data": "train.jsonl", "log_json": "train.jsonl"}, "--log-json train.jsonl is the --data file"),
        ({"data": "x.jsonl", "eval_data": "train.jsonl", "trace": "./train.jsonl"}, "--trace ./train.jsonl is the --eval-data file"),
        ({"log_jsonl": "out/m_pipeline/plan.json"}, "--log-jsonl out/m_pipeline/plan.json is a file of the package"),
        ({"log_json": "m/config.json"}, "--log-json m/config.json is a file of the model's folder"),
        ({"save_hf": "m"}, "--save-hf m would replace the model's folder"),
        ({"save_hf": "."}, "--save-hf . would replace"),
        ({"save_hf": "out"}, "--save-hf out would replace the package"),
        ({"tokenizer": "m", "save_hf": "m/"}, "--save-hf m/ would replace the model's folder"),
    ],
)  # fmt: skip
def test_an_output_that_is_an_input_is_refused(package, options, said):
    with pytest.raises(PipelineConfigError, match="^" + said.replace(".", "\\.")):
        _check(package, **options)


@pytest.mark.parametrize(
    "options",
    [
        {"data": "train.jsonl", "log_json": "summary.json"},  # a new file
        {"log_json": "out/m_pipeline/summary.json"},  # new, inside the package: replaces nothing
        {"save_hf": "tuned"},
        {"save_hf": "out/tuned"},
    ],
)
def test_an_output_beside_the_inputs_is_allowed(package, options):
    _check(package, **options)


def test_weights_named_elsewhere_are_the_input(package, tmp_path, monkeypatch):
    """--weights DIR (FTPIPE_WEIGHTS): that folder is what the run reads, not the recorded one."""
    other = tmp_path / "other"
    other.mkdir()
    monkeypatch.setenv("FTPIPE_WEIGHTS", str(other))
    _check(package, save_hf="m")
    with pytest.raises(PipelineConfigError, match="would replace the model's folder"):
        _check(package, save_hf="other")
