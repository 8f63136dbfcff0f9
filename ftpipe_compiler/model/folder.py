"""A model folder checked before its model is costed: a config whose numbers make sense, and
weights (`*.safetensors`, shards by `model.safetensors.index.json`) that parse and are the
weights of the model the config describes.

    check_config("models/llama", config)                   # at --model resolution
    headers = read_headers(Path("models/llama"))           # {key: Header}: names, shapes, dtypes
    check_weights("models/llama", headers, traced.graph.params)   # after the export

A folder the runtime would refuse (a weight missing, a shape that differs) is refused here,
by the same lookup (`ftpipe_runtime.spec.weights.checkpoint_keys`), before minutes of planning;
a folder it would accept in silence (more layers in the weights than in the config) too.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

from ftpipe_runtime.models.lora import is_adapter
from ftpipe_runtime.spec.weights import checkpoint_keys

from ..errors import FtpipeError

__all__ = ["Header", "check_config", "check_weights", "read_headers"]

INDEX = "model.safetensors.index.json"
# An integer field named like a size or a count, in any family (`n_layer`, `num_hidden_layers`,
# `d_model`, `intermediate_size`, `encoder_ffn_dim`, `num_local_experts`...).
SIZE_OR_COUNT = re.compile(
    r"^(num|n)_|_(size|dim|layers|heads|experts|positions|embeddings|embd|inner|ff)$|^(d_model|d_ff|d_kv)$"
)
# The dimensions transformers names alike in every family (GPT-2's n_layer answers to
# num_hidden_layers through its config's attribute_map): the trace depends on each.
CORE = ("num_hidden_layers", "hidden_size", "num_attention_heads", "vocab_size",
        "intermediate_size", "num_key_value_heads")  # fmt: skip
SHOWN = 5  # mismatches named in the message; the rest counted


def check_config(where: str, config: dict) -> None:
    """config.json as written, before transformers builds a config of it (its own checks
    raise ZeroDivisionError on zero heads, or pass -2 layers): every size or count in it,
    sub-configs included, is an integer no smaller than -1 (0 and -1 are how some families say
    "none": DeBERTa's max_relative_positions), and its `CORE` dimensions (and those of each
    `*_config` in it: a text_config) are positive integers."""
    wrong = [*_sizes(config, ""), *_core(config, "")]
    for key, sub in config.items():
        if isinstance(sub, dict) and key.endswith("_config"):
            wrong += _core(sub, f"{key}.")
    if wrong:
        raise FtpipeError(
            f"{where}: config.json says {_listed(list(dict.fromkeys(wrong)))}, which no model "
            "can have; correct the config (or write it again with save_pretrained)"
        )


def _sizes(config: dict, prefix: str) -> list[str]:
    wrong = []
    for key, value in config.items():
        if isinstance(value, dict):
            wrong += _sizes(value, f"{prefix}{key}.")
        elif isinstance(key, str) and SIZE_OR_COUNT.search(key):
            numbers = _integers(value)
            if isinstance(value, str) or (numbers and min(numbers) < -1):
                wrong.append(f"{prefix}{key} {json.dumps(value)}")
    return wrong


def _core(config: dict, prefix: str) -> list[str]:
    """The `CORE` dimensions under the family's own names (its config class's attribute_map)."""
    names = _attribute_map(config.get("model_type"))
    wrong = []
    for name in CORE:
        native = names.get(name, name)
        value = config.get(native)
        if value is None:
            continue
        numbers = _integers(value)  # one per layer or per part in some families
        if numbers is None or min(numbers, default=1) < 1:
            wrong.append(f"{prefix}{native} {json.dumps(value)}")
    return wrong


def _attribute_map(model_type) -> dict[str, str]:
    """Standard name -> the family's (GPT-2: num_hidden_layers -> n_layer)."""
    try:
        from transformers import CONFIG_MAPPING

        return dict(getattr(CONFIG_MAPPING[model_type], "attribute_map", None) or {})
    except (ImportError, KeyError, TypeError):
        return {}


def _integers(value) -> list[int] | None:
    """The integers of a number, or of a list or object of numbers (per layer, per part);
    None when it holds anything else (a float, a string)."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return [value]
    if not isinstance(value, (list, tuple, dict)):
        return None
    parts = value.values() if isinstance(value, dict) else value
    found = [_integers(v) for v in parts]
    return None if None in found else [n for f in found for n in f]


@dataclass(frozen=True)
class Header:
    """One tensor of a safetensors file, as its header describes it."""

    shape: tuple[int, ...]
    dtype: str  # safetensors' name: F32, BF16, I64, BOOL...
    file: str

    @property
    def floating(self) -> bool:
        return self.dtype.startswith(("F", "BF"))


def read_headers(folder: Path) -> dict[str, Header]:
    """The tensors of the folder's `*.safetensors` (headers only: nothing else is read); an
    index, when there is one, must name only files that are there and keys they hold."""
    files = sorted(Path(folder).glob("*.safetensors"))
    if not files:
        return {}
    try:
        from safetensors import SafetensorError, safe_open
    except ImportError:
        raise FtpipeError(
            "model folders with weights need safetensors: pip install safetensors"
        ) from None
    headers: dict[str, Header] = {}
    for path in files:
        try:
            with safe_open(str(path), framework="pt") as f:
                for key in f.keys():
                    piece = f.get_slice(key)
                    headers[key] = Header(tuple(piece.get_shape()), piece.get_dtype(), path.name)
        except (SafetensorError, OSError, ValueError) as e:
            raise FtpipeError(
                f"{path} is not a readable safetensors file ({_first_line(e)}); is it damaged or "
                "partly downloaded? Get it again, or remove it to start from random weights"
            ) from None
    _check_index(Path(folder), headers)
    return headers


def _check_index(folder: Path, headers: dict[str, Header]) -> None:
    path = folder / INDEX
    if not path.is_file():
        return
    try:
        weight_map = json.loads(path.read_text(encoding="utf-8"))["weight_map"]
        if not isinstance(weight_map, dict):
            raise TypeError("weight_map is no object")
    except (ValueError, KeyError, TypeError, OSError) as e:
        raise FtpipeError(f"{path} is not a valid shard index ({_first_line(e)})") from None
    absent = sorted({str(f) for f in weight_map.values() if not (folder / str(f)).is_file()})
    if absent:
        raise FtpipeError(
            f"{path} names the shards {_listed(absent)}, which are not in the folder; get them "
            "(or the whole folder) again"
        )
    wrong = [
        f"{key} in {file}"
        for key, file in weight_map.items()
        if key not in headers or headers[key].file != file
    ]
    if wrong:
        raise FtpipeError(
            f"{path} names tensors its shards do not hold: {_listed(wrong)}; is a shard missing "
            "or from another download?"
        )


def check_weights(where: str, headers: dict[str, Header], params, converted=None) -> None:
    """The traced parameters (`Param`s: name, aliases, shape, dtype, trainable, frozen)
    against the folder's tensors: each weight found under one of the names the runtime looks
    for, with its shape and a dtype of its kind (a floating-point checkpoint of any width
    loads into any floating-point weight), or every key transformers converts into it
    (`converted`: name -> keys, shapes left to the conversion), buffers only checked when
    present, and no layer in the weights beyond the model's. One sentence listing the
    mismatches."""
    if not headers:
        return
    wrong, used = [], set()
    converted = converted or {}
    for p in params:
        if p.name in converted:
            absent = [k for k in converted[p.name] if k not in headers]
            wrong += [f"{absent[0]} missing from the folder (part of {p.name})"] if absent else []
            used.update(converted[p.name])
            continue
        key = next((k for k in checkpoint_keys(p.name, p.aliases) if k in headers), None)
        if key is None:
            if (p.trainable or p.frozen) and not is_adapter(p.name):
                wrong.append(f"{p.name} missing from the folder")
            continue
        used.add(key)
        h = headers[key]
        if h.shape != tuple(p.shape):
            wrong.append(f"{key} is {list(h.shape)} in the folder, {list(p.shape)} in the model")
        elif h.floating != p.dtype.startswith(("float", "bfloat")):
            wrong.append(f"{key} is {h.dtype} in the folder, {p.dtype} in the model")
    wrong += _extra_layers(headers, used, params)
    if wrong:
        raise FtpipeError(
            f"{where}: the weights are not those of the model its config.json describes: "
            f"{_listed(wrong)}; give the folder its own config.json, or compile its config "
            "alone (random weights)"
        )


def _extra_layers(headers, used: set[str], params) -> list[str]:
    """Keys of numbered layers the model does not have (h.5 when the config says 4 layers):
    weights that would be dropped in silence. Other unused keys (a pretraining head, old
    buffers) are ignored, as transformers ignores them."""
    counts: dict[str, int] = {}
    for p in params:
        for name in (p.name, *p.aliases):
            for full in {name, name.split(".", 1)[-1]}:
                for container, index in _numbered(full):
                    counts[container] = max(counts.get(container, 0), index + 1)
    extra: dict[str, None] = {}
    for key in headers:
        if key in used:
            continue
        for container, index in _numbered(key):
            if container in counts and index >= counts[container]:
                extra[f"{container}.{index}"] = None
                break
    return [f"{layer} not in the model" for layer in extra]


def _numbered(name: str) -> list[tuple[str, int]]:
    """('transformer.h', 3) for every numbered part of 'transformer.h.3.attn.weight'."""
    parts = name.split(".")
    return [(".".join(parts[:i]), int(p)) for i, p in enumerate(parts) if i and p.isdigit()]


def _listed(items: list[str]) -> str:
    shown = ", ".join(items[:SHOWN])
    return shown + (f" and {len(items) - SHOWN} more" if len(items) > SHOWN else "")


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__
