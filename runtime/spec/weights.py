"""Where a weight's value comes from when no trained one is given, the one home for it:
the seeded initial value, the checkpoint keys that may hold a weight, and building a model
whose parameters take no memory. The generated stages (`stage_api.StageModule`) and the
compiler's measured profiler (`ftpipe_compiler.costs.weights`) both use these.

    t = initial_value("encoder.block.0.layer.0.SelfAttention.q.weight", (512, 512), torch.float32)
    keys = checkpoint_keys("transformer.h.0.attn.c_attn.weight", aliases=())  # + "h.0.attn..."
    with parameters_on_meta():
        model = build()             # buffers (position ids...) real, parameters on `meta`

The compiler traces a model wrapped as the attribute `m` of a loss module, so names in a
traced program start with `WRAPPER_PREFIX`; the names stages, checkpoints and plans use do not.
"""

from __future__ import annotations

import os
import zlib
from contextlib import contextmanager
from pathlib import Path

import torch
from torch import nn

__all__ = [
    "INIT_STD",
    "WEIGHTS_ENV",
    "WRAPPER_PREFIX",
    "checkpoint_keys",
    "initial_value",
    "model_folder",
    "parameters_on_meta",
]

INIT_STD = 0.02
WRAPPER_PREFIX = "m."
# A folder of *.safetensors (the model's folder) that overrides the compiled-in one; the
# package's `--weights DIR` sets it.
WEIGHTS_ENV = "FTPIPE_WEIGHTS"


def model_folder(recorded: str, package: Path) -> str:
    """The compiled model's folder (its weights, its tokenizer) on this machine: the one
    `--weights` / $FTPIPE_WEIGHTS names, else the plan's path, relative to the package (a
    package copied to another machine with its model beside it finds it there)."""
    chosen = os.environ.get(WEIGHTS_ENV)
    if chosen:
        return chosen
    return os.path.normpath(Path(package) / recorded) if recorded else ""


def initial_value(name: str, shape, dtype, seed: int = 0) -> torch.Tensor:
    """Biases 0, 1-d weights (norm scales) 1, other weights N(0, 0.02), seeded by the name
    only: the same weights however the model is partitioned, and a weight shared by several
    blocks (tied) is the same tensor in all. A LoRA adapter's B is 0 (as peft starts it: the
    wrapped model starts as its base); integer tensors are 0. On the host."""
    if name.endswith("bias") or ".lora_B." in name or not dtype.is_floating_point:
        return torch.zeros(shape, dtype=dtype)
    if len(shape) == 1 and name.endswith("weight"):
        return torch.ones(shape, dtype=dtype)
    gen = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
    return (torch.randn(shape, generator=gen) * INIT_STD).to(dtype)


def checkpoint_keys(name: str, aliases=()) -> list[str]:
    """Checkpoint keys that may hold `name`: itself, its tied aliases, and the same names
    without the head model's prefix (GPT-2 checkpoints say `h.0...`, not `transformer.h.0...`)."""
    names = [name, *aliases]
    return names + [n.split(".", 1)[1] for n in names if "." in n]


@contextmanager
def parameters_on_meta():
    """Build a model whose buffers are real but whose parameters take no memory. Not
    `torch.device("meta")`: that would put the buffers (position ids computed in
    `__init__`) on `meta` too, and their values are what the caller wants."""
    original = nn.Module.register_parameter

    def register(module, name, param):
        if param is not None and param.device.type != "meta":
            param = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
        original(module, name, param)

    nn.Module.register_parameter = register
    try:
        yield
    finally:
        nn.Module.register_parameter = original
