"""The HuggingFace side of the head rules: classes, configs, forward signatures, the loss.

    head = head_of_class("LlamaForCausalLM")                 # "causal-lm", from transformers' tables
    cls = class_for_head("llama", "sequence-classification")  # "LlamaForSequenceClassification"
    net = build_model(config, "LlamaForCausalLM", dropout=0.0, seed=0)
    loss = loss_of(net, inputs)

Only the compiler, a package's `--check`, and stages loading weights that transformers
converts (MoE experts stored one by one) come here: transformers is imported inside the
functions, never when the runtime is imported.
"""

from __future__ import annotations

import inspect
import re

import torch

from .heads import HEADS, IGNORE, Vocab, get_head, input_names, with_dropout
from .lora import base_name
from .synthetic import decoder_inputs


def _transformers():
    try:
        import transformers
    except ImportError:
        raise ImportError(
            "HuggingFace models need transformers: pip install 'ftpipe[hf]'"
        ) from None
    transformers.logging.set_verbosity_error()
    return transformers


def _mapping(head) -> dict:
    from transformers.models.auto import modeling_auto

    return getattr(modeling_auto, head.mapping)


def _names(entry) -> tuple[str, ...]:
    return tuple(entry) if isinstance(entry, (list, tuple)) else (entry,)


def head_of_class(class_name: str) -> str | None:
    """The head whose transformers table lists `class_name` (None: no head we know)."""
    _transformers()
    for head in HEADS.values():
        if any(class_name in _names(e) for e in _mapping(head).values()):
            return head.name
    return None


def class_for_head(model_type: str, head: str) -> str | None:
    """The class transformers' Auto class of `head` builds for `model_type` (None: none)."""
    _transformers()
    entry = _mapping(get_head(head)).get(model_type)
    return _names(entry)[0] if entry else None


def hf_config(config: dict, dropout: float | None = None):
    """A transformers config from a config.json dict (dropout set to `dropout` when given)."""
    transformers = _transformers()
    config = with_dropout(config, dropout) if dropout is not None else dict(config)
    model_type = config.pop("model_type")
    config.pop("architectures", None)
    return transformers.AutoConfig.for_model(model_type, **config)


def model_class(class_name: str):
    transformers = _transformers()
    try:
        return getattr(transformers, class_name)
    except AttributeError:
        raise ValueError(f"transformers has no model class {class_name!r}") from None


def vocab_of(config) -> Vocab:
    """The figures synthetic inputs need, from a transformers config."""

    def number(name, default):
        value = getattr(config, name, None)
        return value if isinstance(value, int) and not isinstance(value, bool) else default

    return Vocab(
        vocab_size=number("vocab_size", 2),
        type_vocab_size=number("type_vocab_size", 0),
        num_labels=number("num_labels", 2),
        pad_token_id=number("pad_token_id", 0),
        decoder_start_token_id=number("decoder_start_token_id", number("pad_token_id", 0)),
    )


def forward_inputs(class_name: str, head: str, config, *, packed: bool = False) -> tuple[str, ...]:
    """The inputs a `head` of this class takes, named and ordered by its forward signature
    (`packed`: for packed documents, see `heads.input_names`)."""
    params = inspect.signature(model_class(class_name).forward).parameters
    return input_names(get_head(head), list(params), vocab_of(config), packed=packed)


def build_model(
    config: dict,
    class_name: str,
    device="cpu",
    dropout: float | None = None,
    seed: int = 0,
    dtype: torch.dtype | None = None,
) -> torch.nn.Module:
    """The model, randomly initialised from `seed` (on `meta`: no memory), in training mode.

    `dtype` (bf16, fp16): built as `from_pretrained(..., dtype=dtype)` builds it, the default
    dtype set while constructing (buffers made explicitly in fp32, like rotary frequencies,
    stay fp32) and the modules the class keeps in fp32 at that dtype upcast."""
    cls = model_class(class_name)
    hf = hf_config(config, dropout)
    torch.manual_seed(seed)
    default = torch.get_default_dtype()
    try:
        if dtype is not None:
            torch.set_default_dtype(dtype)
            hf.dtype = dtype
        with torch.device(device):
            net = cls(hf)
    finally:
        torch.set_default_dtype(default)
    if dtype is not None:
        _keep_in_fp32(net, dtype)
    return net.train()


def _keep_in_fp32(net: torch.nn.Module, dtype: torch.dtype) -> None:
    """Upcast what transformers keeps in fp32 when loading at `dtype`: `_keep_in_fp32_modules`
    under fp16, `_keep_in_fp32_modules_strict` under fp16 and bf16 (patterns searched in the
    parameter names, as its loader does)."""
    patterns = list(getattr(net, "_keep_in_fp32_modules_strict", None) or ())
    if dtype == torch.float16:
        patterns += list(getattr(net, "_keep_in_fp32_modules", None) or ())
    if not patterns:
        return
    found = re.compile("|".join(p.replace("*", ".*") for p in patterns))
    with torch.no_grad():
        for name, p in net.named_parameters():
            if found.search(name) and p.dtype.is_floating_point:
                p.data = p.data.float()


def loss_of(net: torch.nn.Module, inputs: dict) -> torch.Tensor:
    """The training loss of a HuggingFace model on keyword inputs."""
    # use_cache=False: T5 otherwise returns an EncoderDecoderCache that torch.export rejects.
    cfg = getattr(net, "config", None)
    extra = {"use_cache": False} if getattr(cfg, "use_cache", None) is not None else {}
    out = net(**inputs, **extra)
    return out.loss if hasattr(out, "loss") else out


def own_shift(net: torch.nn.Module, labels: torch.Tensor) -> torch.Tensor | None:
    """The decoder inputs the model itself makes from `labels` (None: it has no such method).
    It reads only the config, so a model on `meta` shifts CPU labels."""
    shift = getattr(net, "prepare_decoder_input_ids_from_labels", None)
    return shift(labels=labels) if shift is not None else None


def shift_agrees(net: torch.nn.Module, vocab: Vocab, model_type: str) -> bool:
    """Whether `decoder_inputs` (what the runtime feeds) is the model's own shift, on labels
    with ignored positions. A model without its own shift has nothing to disagree with."""
    labels = torch.tensor([[5, 7, 9, 11], [3, 4, IGNORE, IGNORE], [6, IGNORE, 8, 2]])
    own = own_shift(net, labels)
    return own is None or torch.equal(own.cpu(), decoder_inputs(labels, vocab, model_type))


def checkpoint_names(net: torch.nn.Module) -> dict[str, str | tuple[str, ...]]:
    """Parameter -> the key a checkpoint stores it under, where transformers renames it when
    loading (GPT-NeoX's `embed_out.weight` is the model's `lm_head.weight`); the keys it is
    made of, as a tuple, where transformers converts them into it (MoE experts stored one by
    one, fused in the model: `converted_weights`)."""
    try:
        from transformers.core_model_loading import revert_weight_conversion
    except ImportError:  # transformers 4: checkpoints hold the model's own names
        return {}
    out = {}
    for name, param in net.named_parameters(remove_duplicate=False):
        stored = revert_weight_conversion(net, {name: param})
        if list(stored) != [name]:
            (key, value), *more = stored.items()
            out[name] = key if not more and value.shape == param.shape else tuple(stored)
    return out


def converted_from_folder(folder, names: list[str], files):
    """(name, tensor) of the model's tensors `names` that transformers makes of other keys of
    the checkpoint in `folder` (its *.safetensors `files`), made as it makes them, one at a
    time (host memory holds one tensor's parts at once); those it does not make are left
    out. The model is built on `meta` from the folder's config.json (its class from
    `architectures`); only the keys these tensors are made of are read."""
    import json
    from pathlib import Path

    from safetensors import safe_open

    try:  # what converted_weights uses too: transformers' loading internals, 5.x
        from transformers.conversion_mapping import get_model_conversion_mapping  # noqa: F401
        from transformers.core_model_loading import (  # noqa: F401
            WeightConverter,
            rename_source_key,
            revert_weight_conversion,
        )
    except ImportError:  # transformers 4, or none: checkpoints hold the model's own names
        return
    config = json.loads((Path(folder) / "config.json").read_text())
    classes = config.get("architectures") or []
    if not classes:
        return
    with torch.random.fork_rng(devices=[]):  # building seeds: the run's own RNG untouched
        net = build_model(config, classes[0], "meta")
    params = dict(net.named_parameters(remove_duplicate=False))
    held = {}  # key -> the file holding it
    for path in files:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            held.update(dict.fromkeys(f.keys(), path))
    for name in names:
        base = name if name in params else base_name(name)  # a LoRA model's: the base's
        keys = list(revert_weight_conversion(net, {base: params[base]})) if base in params else []
        if keys in ([], [base]) or any(k not in held for k in keys):
            continue
        stored = {}
        for k in keys:
            with safe_open(str(held[k]), framework="pt", device="cpu") as f:
                stored[k] = f.get_tensor(k)
        made = converted_weights(net, stored).get(base)
        if made is not None:
            yield name, made


def converted_weights(net: torch.nn.Module, stored: dict) -> dict[str, torch.Tensor]:
    """The model's tensors that transformers makes of these checkpoint tensors when it loads
    them (`stored`: key -> tensor, every key a converted tensor is made of): its own
    conversion rules for the model (`get_model_conversion_mapping`), applied as
    `from_pretrained` applies them. `net` may be on `meta`."""
    from copy import deepcopy

    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import (
        WeightConverter,
        WeightRenaming,
        dot_natural_key,
        rename_source_key,
    )

    rules = get_model_conversion_mapping(net)
    renamings = [r for r in rules if isinstance(r, WeightRenaming)]
    converters = [r for r in rules if isinstance(r, WeightConverter)]
    by_pattern = {p: c for c in converters for p in c.source_patterns}
    pending: dict[str, WeightConverter] = {}
    for key, tensor in sorted(stored.items(), key=lambda kv: dot_natural_key(kv[0])):
        target, pattern = rename_source_key(key, renamings, converters)  # as loading renames
        if pattern is not None:
            pending.setdefault(target, deepcopy(by_pattern[pattern]))
            pending[target].add_tensor(target, key, pattern, tensor)
    out = {}
    for target, converter in pending.items():
        for name, value in converter.convert(target, model=net, config=net.config).items():
            out[name] = value[0] if isinstance(value, list) else value
    return out
