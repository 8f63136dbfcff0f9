"""Model folders are checked before their model is costed: config numbers that make sense,
and safetensors (one file or shards) that parse and hold the traced parameters' names,
shapes and dtypes. Folders are written by `save_pretrained` from tiny configs, then damaged."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

from ftpipe_compiler.errors import FtpipeError
from ftpipe_compiler.graph.trace import trace_model
from ftpipe_compiler.model.folder import check_config, check_weights, read_headers
from ftpipe_compiler.model.tasks import resolve_task
from ftpipe_compiler.model.zoo import resolve_model

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

LLAMA = dict(num_hidden_layers=2, hidden_size=32, num_attention_heads=2, num_key_value_heads=2,
             intermediate_size=64, vocab_size=64, max_position_embeddings=32,
             tie_word_embeddings=True)  # fmt: skip


def _save(folder, shard: str | None = None, **changes):
    config = transformers.LlamaConfig(**{**LLAMA, **changes})
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    model.save_pretrained(folder, **({"max_shard_size": shard} if shard else {}))
    return folder


def _edit_config(folder, **changes):
    path = folder / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))


def _trace(folder):
    spec = resolve_model(str(folder))
    task = resolve_task(spec, None, seq_len=16)
    return trace_model(spec, task, task.micro_batch)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A tiny Llama (tied embeddings: the folder has no lm_head.weight), in one file and in
    shards, and the parameters its trace reads."""
    root = tmp_path_factory.mktemp("folders")
    one, shards = _save(root / "one"), _save(root / "shards", shard="20KB")
    assert (
        len(list(shards.glob("*.safetensors"))) > 2
        and (shards / "model.safetensors.index.json").is_file()
    )
    return one, shards, _trace(one).graph.params


def _copy(folder, tmp_path, name="bad"):
    return shutil.copytree(folder, tmp_path / name)


def test_a_folder_of_its_own_weights_passes(saved):
    one, shards, params = saved
    assert any(p.aliases for p in params)  # the tied embedding: lm_head.weight absent, allowed
    for folder in (one, shards):
        check_weights(str(folder), read_headers(folder), params)
    assert _trace(shards).graph.params == params


@pytest.mark.parametrize(
    "edit, message",
    [
        ({"num_hidden_layers": -2}, "config.json says num_hidden_layers -2, which no model can have"),
        ({"num_attention_heads": 0}, "num_attention_heads 0"),
        ({"vocab_size": "64"}, 'vocab_size "64"'),
        ({"hidden_size": 32.5}, "hidden_size 32.5"),
        ({"rope_scaling": {"factor": 2.0, "original_max_position_embeddings": -8}},
         "rope_scaling.original_max_position_embeddings -8"),
    ],
)  # fmt: skip
def test_a_config_number_no_model_can_have(saved, tmp_path, edit, message):
    """The issue's case first: -2 layers traced into an empty model, its weights ignored."""
    folder = _copy(saved[0], tmp_path)
    _edit_config(folder, **edit)
    with pytest.raises(FtpipeError, match=message.replace("(", r"\(").replace(".", r"\.")):
        resolve_model(str(folder))


@pytest.mark.parametrize("model_type", ["gpt2", "llama", "t5", "bart", "bert", "deberta-v2",
                                        "xlnet", "qwen2_moe", "gemma3n", "swin", "lxmert"])  # fmt: skip
def test_every_familys_default_config_passes(model_type):
    """0 and -1 mean "none" in some families (DeBERTa's type_vocab_size and
    max_relative_positions, XLNet's max_position_embeddings); sizes come as lists per stage
    (Swin) or per layer (Gemma 3n), or per part (LXMERT)."""
    config = transformers.AutoConfig.for_model(model_type)
    check_config(model_type, config.to_dict())


@pytest.mark.slow
def test_no_default_config_of_any_family_is_refused():
    from transformers import CONFIG_MAPPING

    for model_type, cls in CONFIG_MAPPING.items():
        try:
            config = cls()
        except Exception:  # noqa: BLE001 - a few need arguments to exist at all
            continue
        check_config(model_type, config.to_dict())


def _random_bytes(folder):
    (folder / "model.safetensors").write_bytes(os.urandom(5000))


def _truncated(folder):
    path = folder / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[:-1000])


def _empty(folder):
    (folder / "model.safetensors").write_bytes(b"")


@pytest.mark.parametrize(
    "damage, message",
    [
        (_random_bytes, "model.safetensors is not a readable safetensors file"),
        (_truncated, "model.safetensors is not a readable safetensors file .*file not fully covered"),
        (_empty, "model.safetensors is not a readable safetensors file .*header too small"),
    ],
)  # fmt: skip
def test_weights_that_do_not_parse_are_refused_before_the_trace(saved, tmp_path, damage, message):
    folder = _copy(saved[0], tmp_path)
    damage(folder)
    with pytest.raises(FtpipeError, match=message):
        resolve_model(str(folder))


def _shard(folder, n: int):
    return sorted(folder.glob("model-*.safetensors"))[n]


def _index(folder):
    return json.loads((folder / "model.safetensors.index.json").read_text())


def test_a_missing_shard_is_named(saved, tmp_path):
    folder = _copy(saved[1], tmp_path)
    gone = _shard(folder, 1)
    gone.unlink()
    with pytest.raises(
        FtpipeError, match=f"names the shards {gone.name}, which are not in the folder"
    ):
        resolve_model(str(folder))


def test_a_shard_from_another_download(saved, tmp_path):
    """A shard that parses but lacks what the index says it holds."""
    folder = _copy(saved[1], tmp_path)
    shard = _shard(folder, 0)
    held = safetensors_torch.load_file(shard)
    dropped = sorted(held)[0]
    safetensors_torch.save_file({k: v for k, v in held.items() if k != dropped}, shard)
    with pytest.raises(
        FtpipeError, match=f"names tensors its shards do not hold: {dropped} in {shard.name}"
    ):
        resolve_model(str(folder))


def test_a_damaged_index(saved, tmp_path):
    folder = _copy(saved[1], tmp_path)
    (folder / "model.safetensors.index.json").write_text('{"weight_map": ')
    with pytest.raises(
        FtpipeError, match="model.safetensors.index.json is not a valid shard index"
    ):
        resolve_model(str(folder))


def _rewrite(folder, change):
    path = folder / "model.safetensors"
    tensors = safetensors_torch.load_file(path)
    change(tensors)
    safetensors_torch.save_file(tensors, path)


def test_weights_of_another_shape_dtype_or_name_are_listed(saved, tmp_path):
    folder = _copy(saved[0], tmp_path)

    def change(t):
        t["model.layers.0.mlp.up_proj.weight"] = t["model.layers.0.mlp.up_proj.weight"][:32]
        t["model.norm.weight"] = torch.ones(32, dtype=torch.int64)
        t["model.layers.1.input_layernorm.weights"] = t.pop("model.layers.1.input_layernorm.weight")
        t["model.embed_tokens.weight"] = t["model.embed_tokens.weight"].bfloat16()  # fine

    _rewrite(folder, change)
    with pytest.raises(FtpipeError) as e:
        check_weights(str(folder), read_headers(folder), saved[2])
    said = str(e.value)
    assert "the weights are not those of the model its config.json describes" in said
    assert (
        "model.layers.0.mlp.up_proj.weight is [32, 32] in the folder, [64, 32] in the model" in said
    )
    assert "model.norm.weight is I64 in the folder, float32 in the model" in said
    assert "model.layers.1.input_layernorm.weight missing from the folder" in said
    assert "embed_tokens" not in said  # bf16 weights load into an fp32 model


@pytest.mark.parametrize(
    "config, message",
    [
        ({"num_hidden_layers": 1}, "model.layers.1 not in the model"),  # ignored in silence before
        ({"intermediate_size": 96}, r"up_proj.weight is \[64, 32\] in the folder, \[96, 32\] in the model"),
        ({"tie_word_embeddings": False}, "lm_head.weight missing from the folder"),
    ],
)  # fmt: skip
def test_a_config_that_is_not_its_weights(saved, tmp_path, config, message):
    folder = _copy(saved[0], tmp_path)
    _edit_config(folder, **config)
    with pytest.raises(FtpipeError, match=message):
        _trace(folder)
