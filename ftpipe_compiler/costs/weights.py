"""The tensors a measured profile runs with, one block's worth at a time.

    weights = Weights(traced, spec, device, seed)
    params = weights.materialise({"p_lm_head_weight": "lm_head.weight"})  # one block's worth

Weights come, in this order, from the model folder's *.safetensors (only the tensors asked
for are read), from the traced program when it holds real tensors (traced on a real
device), from the model's own buffers (built with its parameters left on `meta`), or from
the runtime's seeded initial value (`ftpipe_runtime.spec.weights.initial_value`: the one the
generated stages start from). The init of a tensor depends only on its name and the seed,
so the parameter shared by several blocks (tied weights) is the same tensor in all of them.
"""

from __future__ import annotations

from pathlib import Path

import torch
from ftpipe_runtime.models import synthetic_batch
from ftpipe_runtime.spec.weights import (
    WRAPPER_PREFIX,
    checkpoint_keys,
    initial_value,
    parameters_on_meta,
)

__all__ = ["Weights"]


class Weights:
    """Parameters, buffers and model inputs on the device, one block's worth at a time."""

    def __init__(self, traced, spec, device, seed: int = 0):
        self.traced, self.spec, self.device, self.seed = traced, spec, device, seed
        self.files = _safetensors_index(spec)
        self.program = _program_tensors(traced)
        real = any(t.device.type != "meta" for t in self.program.values())
        self.source = "safetensors" if self.files else "program" if real else "random"
        self._model = None  # built only when a buffer is needed

    def materialise(self, placeholders: dict) -> dict:
        """placeholder -> tensor on the device, for {placeholder: canonical parameter name}."""
        made = {name: self._tensor(name) for name in dict.fromkeys(placeholders.values())}
        return {ph: made[name] for ph, name in placeholders.items()}

    def model_inputs(self) -> dict:
        """One micro-batch of the inputs the graph was traced with, on the host."""
        if self.spec.kind == "function":
            return self.spec.example_inputs(None, 0, "cpu")
        g = self.traced.graph
        model = {"head": g.meta.get("head"), "vocab": g.meta.get("vocab")}
        model["inputs"] = {i.name: [list(i.shape), i.dtype] for i in g.inputs}
        return synthetic_batch(model, index=0, seed=self.seed)

    def _tensor(self, name: str) -> torch.Tensor:
        p = self.traced.graph.param[name]
        t = self._from_file(name, p.aliases)
        if t is None and self.program.get(name) is not None:
            t = self.program[name] if self.program[name].device.type != "meta" else None
        if t is None and not p.trainable:
            t = self._model_buffer(name)
        if t is None:
            t = initial_value(name, p.shape, getattr(torch, p.dtype), self.seed)
        t = t.to(self.device, getattr(torch, p.dtype)).detach()
        return t.requires_grad_(p.trainable and t.is_floating_point())

    def _from_file(self, name: str, aliases) -> torch.Tensor | None:
        from safetensors import safe_open

        for key in checkpoint_keys(name, aliases):
            if key in self.files:
                with safe_open(self.files[key], framework="pt") as f:
                    return f.get_tensor(key)
        return None

    def _model_buffer(self, name: str) -> torch.Tensor | None:
        if self._model is None:
            if self.spec.kind == "function":  # the user's function builds it its own way
                self._model = self.spec.build("cpu")
            else:
                with parameters_on_meta():
                    self._model = self.spec.build("cpu")
        found = self._model
        for part in (WRAPPER_PREFIX + name).split("."):
            found = getattr(found, part, None)
        return found if isinstance(found, torch.Tensor) else None


def _program_tensors(traced) -> dict:
    """Canonical name -> the program's own tensor (on `meta` when traced there)."""
    program = traced.program
    params, buffers = dict(program.named_parameters()), dict(program.named_buffers())
    out = {}
    for s in program.graph_signature.input_specs:
        t = {"PARAMETER": params, "BUFFER": buffers}.get(s.kind.name, program.constants)
        kind, name = traced.placeholders.get(s.arg.name, ("input", ""))
        if kind == "param" and s.target in t:
            out[name] = t[s.target]
    return out


def _safetensors_index(spec) -> dict:
    """Tensor name -> file, for a local HuggingFace folder with *.safetensors."""
    if spec.kind != "hf-dir":
        return {}
    from safetensors import safe_open

    index = {}
    for path in sorted(Path(spec.path).glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            index.update(dict.fromkeys(f.keys(), str(path)))
    return index
