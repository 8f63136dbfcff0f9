"""What a checkpoint is made of: its folder's name, the identity of the run that made it
(a resumed run must share it), and its tensors' bytes (safetensors, sized and CRC-summed
as they are written). `checkpoint.Checkpoints` saves and loads with these.
"""

from __future__ import annotations

import hashlib
import json
import re
import secrets
import time
import zlib
from pathlib import Path

import torch

__all__ = [
    "FORMAT",
    "STEP_DIR",
    "Summing",
    "default_dir",
    "difference",
    "load_pickled",
    "new_run_id",
    "on_host",
    "plan_hash",
    "read_tensors",
    "run_identity",
    "step_dir",
    "tensor_bytes",
]

FORMAT = 2  # 2: stage weights in safetensors
STEP_DIR = re.compile(r"step-(\d+)$")
# What makes a plan's stages what they are; its costs and the command that made it do not.
_PLAN_KEYS = ("gpus", "loss_stage", "stages", "transfers", "params")


def step_dir(root, step: int) -> Path:
    return Path(root) / f"step-{step:06d}"


# Where a stage's optimizer state lives: the checkpoint is the same either way (a run resumes
# with or without offload or sharding), and plans written before these fields had none.
_PLACEMENT_KEYS = ("offload", "shard_optimizer")


def plan_hash(plan: dict) -> str:
    core = {k: plan.get(k) for k in _PLAN_KEYS} | {"inputs": plan.get("model", {}).get("inputs")}
    if isinstance(core["stages"], list):
        core["stages"] = [
            {k: v for k, v in s.items() if k not in _PLACEMENT_KEYS} if isinstance(s, dict) else s
            for s in core["stages"]
        ]
    return hashlib.sha256(json.dumps(core, sort_keys=True, default=str).encode()).hexdigest()[:16]


def default_dir(plan: dict) -> str:
    """`checkpoints/<model>-<plan hash>`: packages run from one folder never share one."""
    name = re.sub(r"\W+", "_", str(plan.get("model", {}).get("model_name") or "pipeline"))
    return str(Path("checkpoints") / f"{name.strip('_') or 'pipeline'}-{plan_hash(plan)[:8]}")


_TEXT_OPTIONS = ("text_field", "prompt_field", "target_field", "chat_field", "chat_template",
                 "tokenizer", "pack", "truncate")  # fmt: skip


def run_identity(plan: dict, config, schedule: str, micro_batches: int) -> dict:
    """What a resumed run must share with the one that saved: else it is another run."""
    data = config.data or "synthetic"
    if Path(data).is_file():
        data = f"{Path(data).name} ({Path(data).stat().st_size} bytes)"
    text = {k: getattr(config, k, None) for k in _TEXT_OPTIONS if getattr(config, k, None)}
    if getattr(config, "shuffle_seed", None) is not None:
        text["shuffle_seed"] = config.shuffle_seed
    return text | {
        "plan": plan_hash(plan),
        "dtype": getattr(config, "dtype", "fp32"),
        "schedule": schedule,
        "micro_batches": micro_batches,
        "seed": config.seed,
        "data": data,
        "optimizer": config.optimizer,
        "lr": config.lr,
        "warmup": config.warmup,
        "decay": config.decay,
        "decay_fraction": getattr(config, "decay_fraction", 0.1),
        "weight_decay": getattr(config, "weight_decay", 0.0),
        "betas": [getattr(config, "adam_beta1", 0.9), getattr(config, "adam_beta2", 0.999)],
        "eps": getattr(config, "adam_epsilon", 1e-8),
        "clip": config.clip,
    }


def new_run_id() -> str:
    """A name for a new run, unique to it: its checkpoints' manifests carry it, so a folder is
    known to hold one run's steps (when it started, then random)."""
    return f"{time.strftime('%Y%m%dT%H%M%S')}-{secrets.token_hex(4)}"


def tensor_bytes(tensors: dict) -> bytes:
    """A dict of tensors in the safetensors format."""
    from safetensors.torch import save

    return save(tensors, metadata={"format": "pt"})


def read_tensors(path, device="cpu") -> dict:
    """The tensors of a safetensors file (FileNotFoundError when absent)."""
    from safetensors.torch import load_file

    if not Path(path).is_file():
        raise FileNotFoundError(path)
    try:
        return load_file(str(path), device=str(device))
    except Exception as e:  # noqa: BLE001 - safetensors raises its own types on damage
        raise ValueError(f"not a safetensors file: {e}") from None


def load_pickled(path, map_location="cpu"):
    """`torch.load(path, weights_only=True)`: tensors, numbers and containers only. torch's
    warnings about a file it cannot read (a foreign pickle protocol) are silenced: whoever
    calls this turns the exception into one sentence naming the file, and a warning printed
    above it would only bury that sentence."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return torch.load(path, map_location=map_location, weights_only=True)


def difference(saved: dict, mine: dict) -> str | None:
    """The first setting of `mine` that `saved` has otherwise, said (None: the same run)."""
    for key in mine:
        if saved.get(key) != mine[key]:
            return f"{key} {saved.get(key)!r} there, {mine[key]!r} here"
    return None


class Summing:
    """A file wrapper that counts and CRCs what goes through it."""

    def __init__(self, f):
        self.f, self.size, self.crc = f, 0, 0

    def write(self, data) -> int:
        self.size += len(data)
        self.crc = zlib.crc32(data, self.crc)
        return self.f.write(data)

    def flush(self) -> None:
        self.f.flush()


def on_host(state):
    """A copy of an optimizer state (nested tensors) on the host."""
    if isinstance(state, torch.Tensor):
        return state.detach().cpu().clone()
    if isinstance(state, dict):
        return {k: on_host(v) for k, v in state.items()}
    if isinstance(state, (list, tuple)):
        return type(state)(on_host(v) for v in state)
    return state
