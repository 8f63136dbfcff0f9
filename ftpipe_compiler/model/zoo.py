"""The model zoo: turn a `--model` spec into a loss-returning module and its inputs.

spec = resolve_model("t5-3b")            # a shipped config, a local HF folder, a hub id found
                                         # in the local HF cache, or "package.module:function"
task = resolve_task(spec, "rte")         # (tasks.py) shapes, micro-batch, optimizer
model = spec.build("meta")               # LossModel: forward(*inputs) -> loss
inputs = spec.example_inputs(task, 4, "meta")

What a model takes comes from its head (`ftpipe_runtime.models`): the class named by the
config's `architectures` (or `--head`), the input names from that class's forward signature.
No family is listed here: any model transformers can build with one of the heads works.
"""

from __future__ import annotations

import importlib
import json
import re
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
from ftpipe_runtime.models import HEADS, Vocab, get_head, input_shapes, synthetic_batch
from ftpipe_runtime.models.heads import problem_type
from torch import nn

from ..errors import FtpipeError, unknown
from ..resources import config_names, load_config
from . import frozen, hub
from .folder import check_config, read_headers
from .tasks import Task

FUNCTION = re.compile(r"[\w.]+:\w+")


class LossModel(nn.Module):
    """Wraps a HuggingFace model so that `forward(*inputs)` returns the training loss."""

    def __init__(self, model: nn.Module, input_names: tuple[str, ...]):
        super().__init__()
        self.m = model
        self.input_names = input_names

    def forward(self, *args):
        from ftpipe_runtime.models.hf import loss_of

        return loss_of(self.m, dict(zip(self.input_names, args)))


class FunctionModel(nn.Module):
    """A user model from `package.module:function`, called with positional inputs."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.m = model

    def forward(self, *args):
        return self.m(*args)


@dataclass(frozen=True)
class ModelSpec:
    spec: str
    name: str
    kind: str  # zoo | hf-dir | hub | function
    head: str = ""
    hf_class: str = ""
    config: dict = field(default_factory=dict)
    inputs: tuple[str, ...] = ()  # the forward's inputs this head feeds, in its order
    vocab: Vocab = Vocab()
    max_positions: int = 0  # 0: no limit (relative positions)
    path: str = ""  # local HF folder (weights may live there)
    hub_id: str = ""
    default_task: str = ""
    description: str = ""
    parameters: int = 0
    freeze: str = ""  # --freeze: a regex of parameter names to freeze (frozen.py)
    lora: dict | None = None  # --lora: LoraSpec.to_json(), the adapters peft wraps in
    packed: bool = False  # --pack: traced for packed documents (for_packing)

    @property
    def model_type(self) -> str:
        return self.config.get("model_type", "")

    def build(
        self, device="meta", dropout: float | None = None, seed: int = 0, dtype=None
    ) -> nn.Module:
        """The loss-returning model, randomly initialised (on `meta`: no memory at all);
        `dtype` (bf16, fp16): as transformers builds the model at that dtype."""
        if self.kind == "function":
            model, _ = self._call_function()
            model = model.to(dtype) if dtype is not None else model
            return frozen.adapted(FunctionModel(model).to(device), self.freeze, self.lora)
        from ftpipe_runtime.models import hf

        model = hf.build_model(self.config, self.hf_class, device, dropout, seed, dtype)
        if HEADS[self.head].decoder and not hf.shift_agrees(model, self.vocab, self.model_type):
            raise FtpipeError(
                f"{self.spec}: {self.hf_class} makes its decoder inputs from the labels in its own "
                "way; give its model_type a 'shift' rule in ftpipe_runtime/models/heads.py"
            )
        return frozen.adapted(LossModel(model, self.inputs), self.freeze, self.lora)

    def for_packing(self) -> ModelSpec:
        """This causal LM traced for packed documents (`--pack`): position ids in, no 2-D
        attention mask, so the model derives a mask that keeps documents apart
        (ftpipe_runtime.models.packing)."""
        if self.head != "causal-lm":
            what = f"a {self.head} model" if self.head else "a model function"
            raise FtpipeError(
                f"--pack packs documents for a causal LM, and {self.spec} is {what}; leave "
                "--pack out"
            )
        from ftpipe_runtime.models import hf

        try:
            config = hf.hf_config(self.config)
            inputs = hf.forward_inputs(self.hf_class, self.head, config, packed=True)
        except ValueError as e:
            raise FtpipeError(
                f"{self.spec}: {e} (packed documents are told apart by their positions); "
                "leave --pack out"
            ) from None
        return replace(self, inputs=inputs, packed=True)

    def checkpoint_aliases(self, model: nn.Module) -> dict[str, str | tuple[str, ...]]:
        """Parameter -> the other name the folder's checkpoint holds it under (if any), or the
        keys transformers converts into it (a tuple: MoE experts stored one by one, which
        the stages convert as they load, `ftpipe_runtime.models.hf.converted_weights`)."""
        if self.kind == "function" or not any(Path(self.path or "-").glob("*.safetensors")):
            return {}
        from ftpipe_runtime.models.hf import checkpoint_names

        net = model.m.get_base_model() if self.lora else model.m
        names = checkpoint_names(net)
        if self.lora:  # the base model's weights, under its own names in the folder
            wrapped = frozen.base_names(model.m).items()
            return {n: names.get(b, b) for n, b in wrapped if names.get(b, b) != n}
        return names

    def input_shapes(self, task: Task) -> dict[str, tuple[list[int], str]]:
        """name -> (per-sample shape, dtype) of every input, in the order forward takes them."""
        if self.kind == "function":
            _, example = self._call_function()
            return {f"input_{i}": (list(t.shape[1:]), _dtype(t)) for i, t in enumerate(example)}
        head = get_head(self.head)
        return input_shapes(head, self.inputs, task.seq_len, task.target_len, self.vocab)

    def data_model(self, task: Task, micro_batch: int) -> dict:
        """What the runtime's synthetic data reads of a plan's model (ftpipe_runtime.models)."""
        shapes = self.input_shapes(task)
        return {
            "head": self.head,
            "model_type": self.model_type,
            "vocab": self.vocab.to_json(),
            "inputs": {k: [[micro_batch, *s], d] for k, (s, d) in shapes.items()},
        }

    def example_inputs(self, task: Task, micro_batch: int, device="meta", seed: int = 0) -> dict:
        """Inputs of one micro-batch, in the order the model's forward takes them."""
        if self.kind == "function":
            _, example = self._call_function()
            return {f"input_{i}": t.to(device) for i, t in enumerate(example)}
        batch = synthetic_batch(self.data_model(task, micro_batch), index=0, seed=seed)
        return {k: v.to(device) for k, v in batch.items()}

    def function_task(self) -> Task:
        _, example = self._call_function()
        mb = example[0].shape[0] if example and example[0].dim() else 1
        return Task("custom", "", 0, micro_batch=mb, batch=mb * 4)

    def _call_function(self):
        mod, _, fn = self.spec.partition(":")
        try:
            function = getattr(importlib.import_module(mod), fn)
        except (ImportError, AttributeError) as e:
            raise FtpipeError(f"cannot load model function {self.spec!r}: {e}") from None
        try:
            result = function()
        except Exception as e:  # the user's code: say so, with its own message
            raise FtpipeError(
                f"your model function {self.spec} raised {type(e).__name__}: {e}"
            ) from None
        if not (isinstance(result, tuple) and len(result) == 2):
            raise FtpipeError(f"{self.spec} must return (model, example_inputs)")
        model, example = result
        return model, tuple(example) if isinstance(example, (tuple, list)) else (example,)


def _dtype(t: torch.Tensor) -> str:
    return str(t.dtype).removeprefix("torch.")


def resolve_model(spec: str, head: str | None = None) -> ModelSpec:
    """A shipped name, a local HuggingFace folder, a hub id in the local HuggingFace cache
    (a shipped config also answers to its hub id), or `package.module:function`."""
    if head is not None and head not in HEADS:
        raise unknown("head", head, HEADS)
    shipped = None if "/" in spec or "\\" in spec else load_config("models", spec)
    if shipped is not None:
        return _shipped(spec, shipped, head)
    path = Path(spec)
    if path.is_dir():
        return _from_folder(spec, path, "hf-dir", head, path.resolve().name)
    if FUNCTION.fullmatch(spec):
        module = spec.split(":")[0].rsplit(".", 1)[-1]
        return ModelSpec(spec=spec, name=module, kind="function")
    if hub.looks_like_hub_id(spec):
        folder = hub.cached_folder(spec)
        if folder is not None:
            return _from_folder(spec, folder, "hub", head, spec.split("/")[-1], hub_id=spec)
        by_id = [load_config("models", n) for n in config_names("models")]
        by_id = [d for d in by_id if d.get("hub_id", "").lower() == spec.lower()]
        if by_id:
            return _shipped(spec, by_id[0], head)
        raise FtpipeError(hub.not_cached(spec))
    raise unknown(
        "model", spec, config_names("models") + ["<hf folder>", "<hub id>", "<module:function>"]
    )


def _shipped(spec: str, d: dict, head: str | None) -> ModelSpec:
    return _hf_spec(
        spec,
        d["name"],
        "zoo",
        d["config"],
        head,
        hub_id=d.get("hub_id", ""),
        default_task=d.get("default_task", "") if head is None else "",
        description=d.get("description", ""),
        parameters=d.get("parameters", 0),
    )


def _from_folder(spec: str, path: Path, kind: str, head, name: str, **extra) -> ModelSpec:
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise FtpipeError(f"{spec} is a folder but has no config.json; is it a HuggingFace model?")
    try:
        config = json.loads(cfg_file.read_text())
    except (ValueError, OSError) as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise FtpipeError(f"{cfg_file} is not valid JSON ({e})") from None
    if not isinstance(config, dict) or not isinstance(config.get("model_type", ""), str):
        raise FtpipeError(f"{cfg_file} must hold a JSON object with a model_type string")
    read_headers(path)  # weights that do not parse: said now, not after the trace
    return _hf_spec(spec, name, kind, config, head, path=str(path.resolve()), **extra)


def _hf_spec(spec: str, name: str, kind: str, config: dict, head, **extra) -> ModelSpec:
    """The head, class, inputs and vocabulary of a HuggingFace config (transformers needed)."""
    try:
        from ftpipe_runtime.models import hf
    except ImportError as e:
        raise FtpipeError(str(e)) from None
    model_type = config.get("model_type")
    if not model_type:
        raise FtpipeError(f"{spec}: config.json has no model_type; is it a HuggingFace model?")
    heads = ", ".join(HEADS)
    check_config(spec, config)
    try:
        cls = hf.class_for_head(model_type, head) if head else _architecture(spec, config)
        if cls is None:
            raise FtpipeError(
                f"{spec}: transformers has no {head} model for model_type {model_type!r}; "
                f"pass another --head ({heads})"
            )
        head = head or hf.head_of_class(cls)
        if head is None:
            raise FtpipeError(
                f"{spec}: {cls} is none of the heads ftpipe knows; pass --head ({heads})"
            )
        hf_config = hf.hf_config(config)
        inputs = hf.forward_inputs(cls, head, hf_config)
        implied = problem_type(HEADS[head], hf.vocab_of(hf_config))
        if implied and not config.get("problem_type"):  # the head's, not guessed from labels
            config = {**config, "problem_type": implied}
    except FtpipeError:
        raise
    except Exception as e:  # noqa: BLE001 - transformers' and huggingface_hub's checks of it
        said = " ".join(str(e).split())[:300]
        raise FtpipeError(f"{spec}: cannot use this {model_type} model ({said})") from None
    positions = getattr(hf_config, "max_position_embeddings", 0)
    return ModelSpec(
        spec=spec,
        name=name,
        kind=kind,
        head=head,
        hf_class=cls,
        config=config,
        inputs=inputs,
        vocab=hf.vocab_of(hf_config),
        max_positions=positions if isinstance(positions, int) else 0,
        default_task=extra.pop("default_task", "") or HEADS[head].default_task,
        **extra,
    )


def _architecture(spec: str, config: dict) -> str:
    archs = config.get("architectures") or []
    if not archs:
        raise FtpipeError(
            f"{spec}: config.json names no architectures, so the head is unknown; "
            f"pass --head, one of {', '.join(HEADS)}"
        )
    return archs[0]
