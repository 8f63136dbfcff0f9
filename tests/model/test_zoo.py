import json

import pytest
import torch

from ftpipe_compiler.codegen.package import package_name
from ftpipe_compiler.errors import FtpipeError, UnknownNameError
from ftpipe_compiler.model.tasks import Task, resolve_task
from ftpipe_compiler.model.zoo import resolve_model
from ftpipe_compiler.resources import config_names, load_config

# The real models' parameter counts (HuggingFace, tied embeddings counted once).
PUBLISHED = {
    "t5-3b": 2_851_598_336,
    "t5-11b": 11_307_321_344,
    "gpt2-xl": 1_557_611_200,
    "t5-small": 60_506_624,
    "t5-base": 222_903_552,
    "t5-large": 737_668_096,
    "gpt2": 124_439_808,
    "llama-3.2-1b": 1_235_814_400,
    "llama-3.2-3b": 3_212_749_824,
    "llama-3.1-8b": 8_030_261_248,
    "mistral-7b": 7_248_023_552,
    "qwen2.5-7b": 7_615_616_512,
    "qwen2.5-14b": 14_770_033_664,
    "bart-large": 406_291_456,
    "mixtral-8x7b": 46_702_792_704,
    "qwen1.5-moe-a2.7b": 14_315_784_192,
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


def test_every_model_default_task_exists_and_matches_its_head():
    for name in config_names("models"):
        spec = resolve_model(name)
        assert resolve_task(spec, None).head == spec.head


def test_the_head_comes_from_the_architecture_and_the_inputs_from_forward():
    llama, t5, bert, gpt2 = map(resolve_model, ("llama-tiny", "t5-tiny", "bert-tiny", "gpt2-tiny"))
    assert (llama.head, llama.hf_class) == ("causal-lm", "LlamaForCausalLM")
    assert llama.inputs == ("input_ids", "attention_mask", "labels")
    assert t5.head == "seq2seq-lm"
    assert t5.inputs == ("input_ids", "attention_mask", "decoder_input_ids", "labels")
    assert bert.inputs == (
        "input_ids", "attention_mask", "token_type_ids", "start_positions", "end_positions"
    )  # fmt: skip
    assert "token_type_ids" not in gpt2.inputs  # GPT-2's forward takes them; it has no types


def test_unknown_model_lists_the_known_ones():
    with pytest.raises(UnknownNameError, match="t5-3b"):
        resolve_model("t5-4b")


def test_task_of_another_head_is_refused():
    with pytest.raises(FtpipeError, match="is for causal-lm models.*choose one of .*rte"):
        resolve_task(resolve_model("t5-tiny"), "tiny-lm")


def test_seq_len_and_target_len_reshape_the_task():
    spec = resolve_model("t5-3b")
    task = resolve_task(spec, "rte", seq_len=128)
    shapes = spec.input_shapes(task)
    assert shapes["input_ids"][0] == [128] and shapes["attention_mask"][0] == [128]
    assert shapes["decoder_input_ids"][0] == [4] and shapes["labels"][0] == [4]
    task = resolve_task(spec, "rte", target_len=8)
    assert spec.input_shapes(task)["labels"][0] == [8] and task.name == "rte@target8"
    llama = resolve_model("llama-3.1-8b")
    task = resolve_task(llama, None, seq_len=2048)
    assert task.name == "wikitext2@seq2048"
    assert {n: s for n, (s, _) in llama.input_shapes(task).items()} == {
        "input_ids": [2048], "attention_mask": [2048], "labels": [2048]
    }  # fmt: skip
    with pytest.raises(FtpipeError, match="--target-len is for seq2seq-lm"):
        resolve_task(llama, None, target_len=4)


def test_micro_batch_and_batch():
    spec = resolve_model("t5-3b")  # rte: micro-batch 4, batch 40
    assert resolve_task(spec, "rte", micro_batch=2).batch == 20  # as many micro-batches
    task = resolve_task(spec, "rte", micro_batch=2, batch=8)
    assert (task.micro_batch, task.batch, task.micro_batches) == (2, 8, 4)
    with pytest.raises(FtpipeError, match="not a multiple"):
        resolve_task(spec, "rte", micro_batch=3, batch=8)
    with pytest.raises(FtpipeError, match="at least 1"):
        resolve_task(spec, "rte", seq_len=0)


def test_sequences_longer_than_the_positions_are_refused():
    with pytest.raises(FtpipeError, match="64 positions.*--seq-len 64"):
        resolve_task(resolve_model("llama-tiny"), None, seq_len=65)


def test_task_round_trip():
    task = resolve_task(resolve_model("t5-3b"), "rte", seq_len=128)
    assert Task.from_json(json.loads(json.dumps(task.to_json()))) == task


def _save(folder, name="gpt2-tiny", **changes):
    cfg = {**load_config("models", name)["config"], **changes}
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps({k: v for k, v in cfg.items() if v is not None}))
    return folder


def test_local_hf_folder(tmp_path):
    spec = resolve_model(str(_save(tmp_path / "my-gpt")))
    assert spec.kind == "hf-dir" and spec.head == "causal-lm" and spec.name == "my-gpt"
    assert package_name(spec) == "my_gpt_pipeline"
    assert sum(p.numel() for p in spec.build("meta").parameters()) == 31_616


def test_a_path_is_a_folder_even_when_it_has_a_shipped_name(tmp_path, monkeypatch):
    _save(tmp_path / "gpt2", "llama-tiny")
    monkeypatch.chdir(tmp_path)
    assert resolve_model("./gpt2").hf_class == "LlamaForCausalLM"
    assert resolve_model("gpt2").kind == "zoo"


def test_head_option_and_missing_architectures(tmp_path):
    folder = _save(tmp_path / "bert", "bert-tiny", architectures=None)
    with pytest.raises(FtpipeError, match="names no architectures.*--head"):
        resolve_model(str(folder))
    spec = resolve_model(str(folder), head="masked-lm")
    assert spec.hf_class == "BertForMaskedLM" and spec.default_task == "mlm"
    assert spec.inputs == ("input_ids", "attention_mask", "token_type_ids", "labels")
    with pytest.raises(FtpipeError, match="no seq2seq-lm model for model_type 'bert'"):
        resolve_model(str(folder), head="seq2seq-lm")
    with pytest.raises(UnknownNameError, match="unknown head"):
        resolve_model(str(folder), head="regression")


def _hub_cache(root, repo_id: str, config_from: str):
    """A HuggingFace hub cache entry as `hf download` leaves it."""
    entry = root / f"models--{repo_id.replace('/', '--')}"
    _save(entry / "snapshots" / "abc123", config_from)
    (entry / "refs").mkdir()
    (entry / "refs" / "main").write_text("abc123")


def test_hub_ids_come_from_the_local_cache_only(tmp_path, monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # and nothing may go to the network anyway
    _hub_cache(tmp_path, "someone/tiny-llama", "llama-tiny")
    spec = resolve_model("someone/tiny-llama")
    assert spec.kind == "hub" and spec.hub_id == "someone/tiny-llama"
    assert spec.name == "tiny-llama" and spec.hf_class == "LlamaForCausalLM"
    assert spec.path == str(tmp_path / "models--someone--tiny-llama" / "snapshots" / "abc123")
    with pytest.raises(FtpipeError, match=r"`hf download someone/absent --local-dir"):
        resolve_model("someone/absent")


def test_shipped_configs_answer_to_their_hub_ids(tmp_path, monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))
    spec = resolve_model("google-t5/t5-3b")
    assert spec.kind == "zoo" and spec.name == "t5-3b" and spec.parameters == 2_851_598_336
    assert resolve_model("meta-llama/Llama-3.1-8B").name == "llama-3.1-8b"
    _hub_cache(tmp_path, "google-t5/t5-3b", "t5-tiny")  # a cached copy has the real weights
    assert resolve_model("google-t5/t5-3b").kind == "hub"


def test_module_function_spec():
    spec = resolve_model("zoo_fixtures:linear_model")
    assert spec.kind == "function"
    assert package_name(spec) == "zoo_fixtures_pipeline"  # named after the module
    task = resolve_task(spec, None)
    assert spec.input_shapes(task)["input_0"][0] == [64]
    with pytest.raises(FtpipeError, match="own example inputs, so --seq-len does not apply"):
        resolve_task(spec, None, seq_len=16)


def test_module_function_must_return_a_pair():
    spec = resolve_model("zoo_fixtures:not_a_pair")
    with pytest.raises(FtpipeError, match="must return"):
        spec.build("meta")
