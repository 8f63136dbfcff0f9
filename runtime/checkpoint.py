"""Checkpoints: every stage's parameters and optimizer state, every rank's RNG, atomically.

    save_stage(root, step, stage_id, module, optimizer)    # root/step-000004/stage-2.pt
    save_rank(root, step, rank, world)                      # root/step-000004/rank-1.pt, last
    step = latest(root, world)                              # newest step every rank finished
    load_stage(root, step, stage_id, module, optimizer); load_rank(root, step, rank)

Each file is written under a temporary name and renamed (`os.replace` is atomic), and a
rank writes its rank file only after all its stages, so a checkpoint counts as complete
only when every rank's file exists: a run killed mid-save resumes from the one before.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import torch

from .errors import PipelineConfigError

_STEP_DIR = re.compile(r"step-(\d+)$")


def step_dir(root, step: int) -> Path:
    return Path(root) / f"step-{step:06d}"


def _atomic_save(obj, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    torch.save(obj, tmp)
    os.replace(tmp, path)


def _cpu(state):
    if isinstance(state, torch.Tensor):
        return state.detach().cpu().clone()
    if isinstance(state, dict):
        return {k: _cpu(v) for k, v in state.items()}
    if isinstance(state, (list, tuple)):
        return type(state)(_cpu(v) for v in state)
    return state


def save_stage(root, step: int, stage: int, module, optimizer) -> None:
    _atomic_save(
        {
            "stage": stage,
            "step": step,
            "params": _cpu(module.state_dict()),
            "optimizer": _cpu(optimizer.state_dict()) if optimizer is not None else None,
        },
        step_dir(root, step) / f"stage-{stage}.pt",
    )


def save_rank(root, step: int, rank: int, world: int) -> None:
    """The rank's RNG; written last, it marks the rank's part of the checkpoint complete."""
    cuda = torch.cuda.get_rng_state() if torch.cuda.is_available() else None
    rng = {"cpu": torch.get_rng_state(), "cuda": cuda}
    _atomic_save(
        {"rank": rank, "world": world, "step": step, "rng": rng},
        step_dir(root, step) / f"rank-{rank}.pt",
    )


class Saver:
    """The step hook that checkpoints every `every` steps and after the last one."""

    def __init__(self, root, every: int, steps: int, rank: int, world: int):
        self.root, self.every, self.steps, self.rank, self.world = root, every, steps, rank, world
        self.modules: dict = {}
        self.optimizers: dict = {}
        self._saved: dict[int, set] = {}  # step -> stages saved (asynchronous: one at a time)

    def __call__(self, event, step: int) -> None:
        done = step + 1
        if done % self.every and done != self.steps:
            return
        for s in event.stages:
            save_stage(self.root, done, s, self.modules[s], self.optimizers[s])
        self._saved.setdefault(done, set()).update(event.stages)
        if self._saved[done] == set(self.modules):
            save_rank(self.root, done, self.rank, self.world)
            del self._saved[done]


def latest(root, world: int) -> int | None:
    """The newest step whose checkpoint every rank finished, or None."""
    best = None
    for d in Path(root).glob("step-*") if Path(root).is_dir() else []:
        m = _STEP_DIR.search(d.name)
        if m and all((d / f"rank-{r}.pt").is_file() for r in range(world)):
            best = max(best or 0, int(m.group(1)))
    return best


def load_stage(root, step: int, stage: int, module, optimizer, device) -> None:
    path = step_dir(root, step) / f"stage-{stage}.pt"
    if not path.is_file():
        raise PipelineConfigError(f"checkpoint {path.parent} has no stage {stage}: another plan?")
    state = torch.load(path, map_location=device, weights_only=True)
    module.load_state_dict(state["params"])
    if optimizer is not None and state["optimizer"] is not None:
        optimizer.load_state_dict(state["optimizer"])


def load_rank(root, step: int, rank: int) -> None:
    state = torch.load(
        step_dir(root, step) / f"rank-{rank}.pt", map_location="cpu", weights_only=True
    )
    torch.set_rng_state(state["rng"]["cpu"])
    if state["rng"]["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["rng"]["cuda"])
