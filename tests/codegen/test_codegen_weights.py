"""Real weights: a stage reads its own tensors, by name or alias, from a model's safetensors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from codegen_helpers import contiguous, costed
from ftpipe_runtime.errors import PipelineConfigError
from ftpipe_runtime.job import check

from ftpipe_compiler.codegen import check_package, generate_package, import_package
from ftpipe_compiler.model.zoo import resolve_model

safetensors = pytest.importorskip("safetensors.torch")


@pytest.fixture(scope="module")
def t5_folder(tmp_path_factory):
    """A HuggingFace folder (config.json + model.safetensors) of tiny T5, not seed-0 weights."""
    folder = tmp_path_factory.mktemp("ckpt") / "t5_ckpt"
    model = resolve_model("t5-tiny").build("cpu", dropout=0.0, seed=123).m
    model.save_pretrained(folder)
    assert list(folder.glob("*.safetensors"))
    return folder


def test_checkpoint_weights_reach_the_stages(t5_folder, tmp_path, monkeypatch):
    monkeypatch.delenv("FTPIPE_WEIGHTS", raising=False)
    spec, _, traced, graph = costed(str(t5_folder), task="tiny-seq2seq")
    plan = contiguous(graph, 3, gpus=2)
    pkg = generate_package(traced, graph, plan, spec, tmp_path, command="pytest")
    assert pkg.name == "t5_ckpt_pipeline"
    mod = import_package(pkg)
    # The folder relative to the package (no path of this machine baked in).
    recorded = json.loads((pkg / "plan.json").read_text())["model"]["path"]
    assert not recorded.startswith("/") and (pkg / recorded).resolve() == t5_folder.resolve()
    assert Path(mod.load_plan()["model"]["path"]).resolve() == t5_folder.resolve()  # found
    result = check_package(pkg)  # reference and stages both read the checkpoint
    assert result.ok, result

    # Independently: the loss of transformers' own loader on the same inputs.
    import transformers

    net = transformers.T5ForConditionalGeneration.from_pretrained(t5_folder)
    loss = net(**check.synthetic_inputs(mod.load_plan()), use_cache=False).loss
    assert result.loss == pytest.approx(loss.item(), rel=1e-5)
    # A folder without the weights is refused, never trained from random weights.
    monkeypatch.setenv("FTPIPE_WEIGHTS", str(tmp_path / "nowhere"))
    with pytest.raises(PipelineConfigError, match="holds no \\*.safetensors weights"):
        mod.STAGES[0]()


def test_stage_reads_only_its_tensors_and_aliases(tmp_path, monkeypatch):
    """GPT-2 checkpoints name the base model's tensors without `transformer.` and may omit the
    tied lm_head: stages still find every tensor."""
    spec, _, traced, graph = costed("gpt2-tiny")
    pkg = generate_package(traced, graph, contiguous(graph, 2), spec, tmp_path, command="pytest")
    model = spec.build("cpu", dropout=0.0, seed=7).m
    state = {
        k.removeprefix("transformer."): v.contiguous()
        for k, v in model.state_dict().items()
        if k != "lm_head.weight"
    }
    folder = tmp_path / "ckpt"
    folder.mkdir()
    safetensors.save_file(state, str(folder / "model.safetensors"))
    monkeypatch.setenv("FTPIPE_WEIGHTS", str(folder))
    mod = import_package(pkg)
    expected = dict(model.named_parameters())
    for cls in mod.STAGES.values():
        stage = cls()
        assert stage.load_weights(folder) == sorted(n for n, *_ in cls.PARAMS)
        for name, t in stage.named_parameters():
            assert torch.equal(t, expected[name]), name


def test_missing_weight_is_an_error(tmp_path, monkeypatch):
    spec, _, traced, graph = costed("gpt2-tiny")
    pkg = generate_package(traced, graph, contiguous(graph, 2), spec, tmp_path, command="pytest")
    folder = tmp_path / "partial"
    folder.mkdir()
    safetensors.save_file(
        {"transformer.wte.weight": torch.zeros(128, 32)}, str(folder / "a.safetensors")
    )
    monkeypatch.setenv("FTPIPE_WEIGHTS", str(folder))
    mod = import_package(pkg)
    with pytest.raises(ValueError, match="not in"):
        mod.STAGES[0]()
