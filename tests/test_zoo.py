import json

import pytest
import torch

from ftpipe_compiler.errors import FtpipeError, UnknownNameError
from ftpipe_compiler.resources import config_names, load_config
from ftpipe_compiler.zoo import resolve_model, resolve_task

# The real models' parameter counts (HuggingFace, tied embeddings counted once).
PUBLISHED = {
    "t5-3b": 2_851_598_336,
    "t5-11b": 11_307_321_344,
    "gpt2-xl": 1_557_611_200,
    "t5-small": 60_506_624,
    "t5-base": 222_903_552,
    "t5-large": 737_668_096,
    "gpt2": 124_439_808,
}


@pytest.mark.parametrize("name", config_names("models"))
def test_every_shipped_config_builds_to_its_parameter_count(name):
    spec = resolve_model(name)
    model = spec.build("meta")
    built = sum(p.numel() for p in model.parameters())
    assert built == spec.parameters
    if name in PUBLISHED:
        assert built == PUBLISHED[name]


def test_bert_large_body_matches_the_published_count():
    import transformers

    cfg = dict(load_config("models", "bert-large")["config"])
    cfg.pop("architectures", None)
    config = transformers.AutoConfig.for_model(cfg.pop("model_type"), **cfg)
    with torch.device("meta"):
        body = transformers.BertModel(config)
    assert sum(p.numel() for p in body.parameters()) == 335_141_888


def test_every_model_default_task_exists_and_matches_family():
    for name in config_names("models"):
        spec = resolve_model(name)
        task = resolve_task(spec, None)
        assert task.family == spec.family


def test_unknown_model_lists_the_known_ones():
    with pytest.raises(UnknownNameError, match="t5-3b"):
        resolve_model("t5-4b")


def test_task_of_another_family_is_refused():
    with pytest.raises(FtpipeError, match="for gpt2 models"):
        resolve_task(resolve_model("t5-tiny"), "tiny-gpt2")


def test_seq_len_overrides_encoder_side_only():
    task = resolve_task(resolve_model("t5-3b"), "rte", seq_len=128)
    assert task.inputs["input_ids"][0] == [128]
    assert task.inputs["decoder_input_ids"][0] == [4]


def test_local_hf_folder(tmp_path):
    cfg = load_config("models", "gpt2-tiny")["config"]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    spec = resolve_model(str(tmp_path))
    assert spec.kind == "hf-dir" and spec.family == "gpt2"
    assert sum(p.numel() for p in spec.build("meta").parameters()) == 31_616


def test_module_function_spec():
    spec = resolve_model("zoo_fixtures:linear_model")
    assert spec.kind == "function"
    task = resolve_task(spec, None)
    assert task.inputs["input_0"][0] == [64]


def test_module_function_must_return_a_pair():
    spec = resolve_model("zoo_fixtures:not_a_pair")
    with pytest.raises(FtpipeError, match="must return"):
        spec.build("meta")
