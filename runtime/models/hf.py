"""The HuggingFace side of the head rules: classes, configs, forward signatures, the loss.

    head = head_of_class("LlamaForCausalLM")                 # "causal-lm", from transformers' tables
    cls = class_for_head("llama", "sequence-classification")  # "LlamaForSequenceClassification"
    net = build_model(config, "LlamaForCausalLM", dropout=0.0, seed=0)
    loss = loss_of(net, inputs)

Only the compiler and a package's `--check` come here: transformers is imported inside the
functions, never when the runtime is imported.
"""

from __future__ import annotations

import inspect
import re

import torch

from .heads import HEADS, IGNORE, Vocab, get_head, input_names, with_dropout
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


def checkpoint_names(net: torch.nn.Module) -> dict[str, str | None]:
    """Parameter -> the key a checkpoint stores it under, where transformers renames it when
    loading (GPT-NeoX's `embed_out.weight` is the model's `lm_head.weight`); None where it
    converts the tensor itself (MoE experts stored one by one, fused in the model)."""
    try:
        from transformers.core_model_loading import revert_weight_conversion
    except ImportError:  # transformers 4: checkpoints hold the model's own names
        return {}
    out = {}
    for name, param in net.named_parameters(remove_duplicate=False):
        stored = revert_weight_conversion(net, {name: param})
        if list(stored) != [name]:
            (key, value), *more = stored.items()
            out[name] = key if not more and value.shape == param.shape else None
    return out
