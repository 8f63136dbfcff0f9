"""The model zoo: turn a `--model` spec and a task into a loss-returning module and inputs.

spec = resolve_model("t5-3b")            # shipped config, or a local HF folder,
                                         # or "package.module:function"
task = resolve_task(spec, "rte")         # input shapes, micro-batch, optimizer
model = spec.build("meta")               # LossModel: forward(**inputs) -> loss
inputs = spec.example_inputs(task, 4, "meta")
"""

from __future__ import annotations

import importlib
import json
import re
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
from torch import nn

from .errors import FtpipeError, unknown
from .resources import config_names, load_config


@dataclass(frozen=True)
class Task:
    name: str
    family: str
    inputs: dict  # name -> (per-sample shape, dtype)
    micro_batch: int
    batch: int
    optimizer: str
    lr: float
    description: str = ""

    @property
    def micro_batches(self) -> int:
        return max(1, self.batch // self.micro_batch)

    def with_seq_len(self, seq_len: int | None) -> Task:
        """Override the encoder-side sequence length (inputs whose names are not decoder_*)."""
        if not seq_len:
            return self
        new = {}
        for k, (shape, dtype) in self.inputs.items():
            if (
                shape
                and not k.startswith("decoder")
                and not (k == "labels" and self.family == "t5")
            ):
                shape = [seq_len, *shape[1:]]
            new[k] = (list(shape), dtype)
        return replace(self, inputs=new, name=f"{self.name}@{seq_len}")


class LossModel(nn.Module):
    """Wraps a HuggingFace model so that `forward(**inputs)` returns the training loss."""

    def __init__(self, model: nn.Module, input_names: tuple[str, ...]):
        super().__init__()
        self.m = model
        self.input_names = input_names

    def forward(self, *args):
        out = self.m(**dict(zip(self.input_names, args)), **self._extra())
        return out.loss if hasattr(out, "loss") else out

    def _extra(self) -> dict:
        # use_cache=False: T5 otherwise returns an EncoderDecoderCache that export rejects.
        cfg = getattr(self.m, "config", None)
        return {"use_cache": False} if getattr(cfg, "use_cache", None) is not None else {}


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
    kind: str  # zoo | hf-dir | function
    family: str = ""
    hf_class: str = ""
    config: dict = field(default_factory=dict)
    path: str = ""  # local HF folder (weights may live there)
    default_task: str = ""
    description: str = ""
    parameters: int = 0

    @property
    def package_name(self) -> str:
        return re.sub(r"\W", "_", self.name).strip("_").lower() + "_pipeline"

    def build(self, device="meta", dropout: float | None = None, seed: int = 0) -> nn.Module:
        """The loss-returning model, randomly initialised (on `meta`: no memory at all)."""
        if self.kind == "function":
            model, _ = self._call_function()
            return FunctionModel(model).to(device)
        config = dict(self.config)
        if dropout is not None:
            for k in list(config):
                if "dropout" in k or k.endswith("_pdrop") or k.endswith("_prob"):
                    if isinstance(config[k], float):
                        config[k] = dropout
        cls = _hf_class(self.hf_class)
        hf_config = _hf_config(config)
        torch.manual_seed(seed)
        with torch.device(device):
            model = cls(hf_config)
        model.train()
        return LossModel(model, tuple(self._input_names()))

    def _input_names(self):
        return _FAMILY_INPUTS.get(self.family, ())

    def example_inputs(self, task: Task, micro_batch: int, device="meta", seed: int = 0) -> dict:
        """Inputs of one micro-batch, in the order the model's forward takes them."""
        if self.kind == "function":
            _, example = self._call_function()
            return {f"input_{i}": t.to(device) for i, t in enumerate(example)}
        gen = torch.Generator().manual_seed(seed)
        vocab = int(self.config.get("vocab_size", 2))
        out = {}
        for name in self._input_names():
            if name not in task.inputs:
                continue
            shape, dtype = task.inputs[name]
            shape = (micro_batch, *shape)
            if name == "attention_mask":
                t = torch.ones(shape, dtype=torch.long)
            elif name == "token_type_ids":
                t = torch.zeros(shape, dtype=torch.long)
            elif name in ("start_positions", "end_positions"):
                seq = task.inputs["input_ids"][0][0]
                t = torch.randint(0, seq, shape, generator=gen)
            else:
                t = torch.randint(0, vocab, shape, generator=gen)
            out[name] = t.to(getattr(torch, dtype)).to(device)
        if self.family == "gpt2" and "labels" in out:
            out["labels"] = out["input_ids"].clone()
        return out

    def _call_function(self):
        mod, _, fn = self.spec.partition(":")
        try:
            result = getattr(importlib.import_module(mod), fn)()
        except (ImportError, AttributeError) as e:
            raise FtpipeError(f"cannot load model function {self.spec!r}: {e}") from None
        if not (isinstance(result, tuple) and len(result) == 2):
            raise FtpipeError(f"{self.spec} must return (model, example_inputs)")
        model, example = result
        return model, tuple(example) if isinstance(example, (tuple, list)) else (example,)


_FAMILY_INPUTS = {
    "t5": ("input_ids", "attention_mask", "decoder_input_ids", "labels"),
    "gpt2": ("input_ids", "labels"),
    "bert": ("input_ids", "attention_mask", "token_type_ids", "start_positions", "end_positions"),
}


def _hf_class(name: str):
    try:
        import transformers
    except ImportError:
        raise FtpipeError(
            "HuggingFace models need transformers: pip install 'ftpipe[hf]'"
        ) from None
    try:
        return getattr(transformers, name)
    except AttributeError:
        raise FtpipeError(f"transformers has no model class {name!r}") from None


def _hf_config(config: dict):
    import transformers

    config = dict(config)
    model_type = config.pop("model_type")
    config.pop("architectures", None)
    return transformers.AutoConfig.for_model(model_type, **config)


def resolve_model(spec: str) -> ModelSpec:
    """A shipped name, a local HuggingFace folder, or `package.module:function`."""
    d = load_config("models", spec)
    if d is not None:
        return ModelSpec(
            spec=spec,
            name=d["name"],
            kind="zoo",
            family=d["family"],
            hf_class=d["hf_class"],
            config=d["config"],
            default_task=d.get("default_task", ""),
            description=d.get("description", ""),
            parameters=d.get("parameters", 0),
        )
    path = Path(spec)
    if path.is_dir():
        cfg_file = path / "config.json"
        if not cfg_file.is_file():
            raise FtpipeError(
                f"{spec} is a folder but has no config.json; is it a HuggingFace model?"
            )
        config = json.loads(cfg_file.read_text())
        family = config.get("model_type", "")
        if family not in _FAMILY_INPUTS:
            raise FtpipeError(
                f"{spec}: model_type {config.get('model_type')!r} is not supported yet "
                f"(supported: {', '.join(_FAMILY_INPUTS)}); use a package.module:function spec"
            )
        arch = (config.get("architectures") or [None])[0] or _DEFAULT_CLASS[family]
        return ModelSpec(
            spec=spec,
            name=path.resolve().name,
            kind="hf-dir",
            family=family,
            hf_class=arch,
            config=config,
            path=str(path.resolve()),
            default_task=_DEFAULT_TASK[family],
        )
    if re.fullmatch(r"[\w.]+:\w+", spec):
        return ModelSpec(spec=spec, name=spec.split(":")[1], kind="function")
    raise unknown("model", spec, config_names("models") + ["<hf folder>", "<module:function>"])


_DEFAULT_CLASS = {
    "t5": "T5ForConditionalGeneration",
    "gpt2": "GPT2LMHeadModel",
    "bert": "BertForQuestionAnswering",
}
_DEFAULT_TASK = {"t5": "rte", "gpt2": "wikitext2", "bert": "squad"}


def resolve_task(spec: ModelSpec, name: str | None, seq_len: int | None = None) -> Task:
    """The task's shapes; by default the model's default task."""
    if spec.kind == "function":
        _, example = spec._call_function()
        inputs = {
            f"input_{i}": (list(t.shape[1:]), str(t.dtype).removeprefix("torch."))
            for i, t in enumerate(example)
        }
        mb = example[0].shape[0] if example and example[0].dim() else 1
        return Task("custom", "custom", inputs, mb, mb * 4, "adamw", 1e-4)
    name = name or spec.default_task
    d = load_config("tasks", name)
    if d is None:
        raise unknown("task", name, config_names("tasks"))
    if d["family"] != spec.family:
        raise FtpipeError(
            f"task {name!r} is for {d['family']} models, not {spec.family} ({spec.name})"
        )
    task = Task(
        name=d["name"],
        family=d["family"],
        inputs={k: (_shape(v[0]), v[1]) for k, v in d["inputs"].items()},
        micro_batch=d["micro_batch"],
        batch=d["batch"],
        optimizer=d["optimizer"],
        lr=d["lr"],
        description=d.get("description", ""),
    )
    return task.with_seq_len(seq_len)


def _shape(s) -> list[int]:
    """Task files write a per-sample shape as a list, or one number for a 1-d input."""
    return [s] if isinstance(s, int) else list(s)
