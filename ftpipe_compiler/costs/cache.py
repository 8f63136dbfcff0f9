"""What a measured profile depends on: the tensors it runs with, and the cache of its results.

    weights = Weights(traced, spec, device, seed)
    params = weights.materialise({"p_lm_head_weight": "lm_head.weight"})  # one block's worth
    key = profile_key(spec, graph, granularity="layer", device="cpu (x86_64, 2 threads)", ...)
    graph = load_profile(key, graph)      # None on a miss
    save_profile(key, costed)

Weights come, in this order, from the model folder's *.safetensors (only the tensors asked
for are read), from the traced program when it holds real tensors (traced on a real
device), from the model's own buffers (built with its parameters left on `meta`), or from a
seeded random init: normal(0, 0.02) for matrices, ones for 1-d weights, zeros for biases
and integer tensors. The init of a tensor depends only on its name and the seed, so the
parameter shared by several blocks (tied weights) is the same tensor in all of them.

Cache files live in `~/.cache/ftpipe/profiles/` unless `FTPIPE_CACHE_DIR` or `cache_dir` says
otherwise, one costed-graph JSON per key. The key hashes everything a timing depends on:
the model spec and its config, the traced graph (ids, ops, shapes), input shapes,
micro-batch, granularity, device, torch version, repeats and seed.
"""

from __future__ import annotations

import hashlib
import json
import os
import zlib
from contextlib import contextmanager
from pathlib import Path

import torch
from ftpipe_runtime.errors import WriteFailed
from ftpipe_runtime.models import synthetic_batch
from torch import nn

from ..errors import PlanFormatError
from ..graph.opgraph import OpGraph

CACHE_FORMAT = 2  # 2: weight-gradient times (wgrad_s) measured


def profile_dir(cache_dir=None) -> Path:
    if cache_dir is not None:
        return Path(cache_dir)
    env = os.environ.get("FTPIPE_CACHE_DIR")
    return Path(env) if env else Path.home() / ".cache" / "ftpipe" / "profiles"


def profile_key(spec, graph: OpGraph, **settings) -> str:
    """A hex digest of what the measured times depend on; `settings` are the profiler's options."""
    shape = hashlib.sha256()
    for n in graph.nodes:
        shape.update(f"{n.id}|{n.op}|{n.shape}|{n.dtype}|{','.join(n.members)}\n".encode())
    fields = {
        "format": CACHE_FORMAT,
        "model": spec.spec,
        "kind": spec.kind,
        "hf_class": spec.hf_class,
        "config": spec.config,
        "freeze": spec.freeze,  # frozen weights change the backward measured
        "lora": spec.lora,
        "inputs": [[i.name, list(i.shape), i.dtype] for i in graph.inputs],
        "micro_batch": graph.meta.get("micro_batch"),
        "graph": shape.hexdigest(),
        "torch": torch.__version__,
        **settings,
    }
    text = json.dumps(fields, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def load_profile(key: str, graph: OpGraph, cache_dir=None) -> OpGraph | None:
    """The cached costed graph for `key`, or None when absent, damaged or of another graph."""
    path = profile_dir(cache_dir) / f"{key}.json"
    if not path.is_file():
        return None
    try:
        cached = OpGraph.load(path)
    except (PlanFormatError, KeyError, TypeError):
        return None  # a damaged entry is a miss; the fresh profile overwrites it
    if [n.id for n in cached.nodes] != [n.id for n in graph.nodes]:
        return None
    return cached


def save_profile(key: str, graph: OpGraph, cache_dir=None) -> Path:
    """Written atomically (`OpGraph.save`): a profile killed half-way leaves no truncated entry."""
    folder = profile_dir(cache_dir)
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise WriteFailed(f"cannot create the profile cache {folder}: {e.strerror}") from None
    path = folder / f"{key}.json"
    graph.save(path)
    return path


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
            t = self._random(name, p.shape, getattr(torch, p.dtype))
        t = t.to(self.device, getattr(torch, p.dtype)).detach()
        return t.requires_grad_(p.trainable and t.is_floating_point())

    def _from_file(self, name: str, aliases) -> torch.Tensor | None:
        from safetensors import safe_open

        for n in (name, *aliases):
            # Base-model checkpoints drop the head's prefix: "transformer.h.0..." -> "h.0...".
            for key in (n, n.split(".", 1)[-1]):
                if key in self.files:
                    with safe_open(self.files[key], framework="pt") as f:
                        return f.get_tensor(key)
        return None

    def _model_buffer(self, name: str) -> torch.Tensor | None:
        if self._model is None:
            if self.spec.kind == "function":  # the user's function builds it its own way
                self._model = self.spec.build("cpu")
            else:
                with _parameters_on_meta():
                    self._model = self.spec.build("cpu")
        found = self._model
        for part in f"m.{name}".split("."):
            found = getattr(found, part, None)
        return found if isinstance(found, torch.Tensor) else None

    def _random(self, name: str, shape, dtype) -> torch.Tensor:
        g = torch.Generator(device=self.device)
        g.manual_seed(zlib.crc32(f"{self.seed}:{name}".encode()))
        t = torch.empty(shape, dtype=dtype, device=self.device)
        if not t.is_floating_point():
            return t.zero_()
        if t.dim() >= 2:
            return t.normal_(0.0, 0.02, generator=g)
        return t.zero_() if name.endswith("bias") else t.fill_(1.0)


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


@contextmanager
def _parameters_on_meta():
    """Build a model whose buffers are real but whose parameters take no memory."""
    register = nn.Module.register_parameter

    def on_meta(module, name, param):
        register(module, name, param)
        if param is not None and param.device.type != "meta":
            p = module._parameters[name]
            module._parameters[name] = nn.Parameter(p.to("meta"), requires_grad=p.requires_grad)

    nn.Module.register_parameter = on_meta
    try:
        yield
    finally:
        nn.Module.register_parameter = register
