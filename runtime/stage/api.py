"""What generated stage modules build on: parameters under their original names, and weights.

A generated `StageK` subclasses `StageModule` and lists its tensors in `PARAMS`; this module
creates them in a tree of plain modules, so `stage.state_dict()` keys are the model's own names
(`encoder.block.3.layer.0.SelfAttention.q.weight`) and its code reads
`self.encoder.block[3].layer[0].SelfAttention.q.weight`. Imports only torch (safetensors lazily).
"""

from __future__ import annotations

import importlib
import itertools
import os
from pathlib import Path
from typing import NamedTuple

import torch
from torch import nn

from ..errors import PipelineConfigError
from ..models.lora import is_adapter
from ..spec.weights import WEIGHTS_ENV, checkpoint_keys, initial_value
from . import fused_loss

__all__ = ["STAGE_API", "Param", "StageModule", "import_ops", "run_in_one_process"]

# The interface generated stages.py is written against: this module's `StageModule` class
# attributes, `Param`, and the package entry `ftpipe_runtime.job.cli.main(argv, stages,
# plan_path, package)`. Bumped when any of them changes shape; a generated stage declares the
# one it was written for (`API`) and is refused, in one sentence, by a runtime of another.
STAGE_API = 1


class Param(NamedTuple):
    """One tensor a generated stage holds: trainable ones become parameters, the others
    frozen parameters (named in FROZEN) or buffers."""

    name: str  # the model's own name (state_dict key)
    shape: tuple[int, ...]
    dtype: str  # a torch dtype's name: "float32", "bfloat16", "int64"
    trainable: bool
    aliases: tuple[str, ...] = ()  # other names of the same tensor (tied weights)


class Scope(nn.Module):
    """A node of the parameter tree; `scope[3]` reads child "3" the way a ModuleList does."""

    def __getitem__(self, index) -> nn.Module:
        return self._modules[str(index)]


class StageModule(nn.Module):
    """Base of generated stages. Subclasses set the class attributes below and `forward`."""

    API: int = STAGE_API  # the stage interface the subclass was generated for
    STAGE: int = 0
    INPUTS: tuple[str, ...] = ()
    OUTPUTS: tuple[str, ...] = ()
    PARAMS: tuple[Param, ...] = ()
    # Frozen weights among the non-trainable PARAMS: parameters with requires_grad False
    # (weights of the model, initialised and loaded like trainable ones; no gradient, no
    # optimizer state). The other non-trainable ones are buffers (position ids...).
    FROZEN: tuple[str, ...] = ()
    BUFFERS_FILE: Path | None = None  # values of the non-trainable tensors (position ids...)
    # The model's folder when it held *.safetensors, relative to the package (generated:
    # `Path(__file__).parent / "../model"`, so a package copied with its model still finds it).
    WEIGHTS_DIR: str = ""
    TRACED_DTYPE: str = "float32"  # the compute dtype the code was traced in

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if cls.API != STAGE_API:
            raise PipelineConfigError(
                f"{cls.__module__} was generated for stage interface {cls.API}, and this "
                f"ftpipe_runtime has interface {STAGE_API}; compile the package again with "
                "this ftpipe"
            )

    def __init__(self, device="cpu", dtype=None, materialize=True):
        """`dtype`: the compute dtype to run in (default: the traced one). Tensors traced in
        the traced compute dtype take it; others (fp32 islands, integer ids) keep theirs."""
        super().__init__()
        fused_loss.register()  # torch.ops.ftpipe, which a generated forward may call
        traced = getattr(torch, self.TRACED_DTYPE)
        self.compute_dtype = dtype or traced
        where = torch.device(device) if materialize else torch.device("meta")
        for name, shape, dt, trainable, _ in map(Param._make, self.PARAMS):
            dt = getattr(torch, dt)
            if dt == traced:
                dt = self.compute_dtype
            t = torch.empty(tuple(shape), dtype=dt, device=where)
            owner, leaf = self._owner(name)
            if trainable or name in self.FROZEN:
                owner.register_parameter(leaf, nn.Parameter(t, requires_grad=trainable))
            else:
                owner.register_buffer(leaf, t)
        self._device = where
        if materialize:
            self.reset_parameters()
            folder = weights_folder(self)
            if folder:  # a folder without its weights is an error, not random weights
                self.load_weights(folder)

    @property
    def device(self) -> torch.device:
        """Where the stage's tensors are (it may have been moved since it was built)."""
        first = next(itertools.chain(self.parameters(), self.buffers()), None)
        return first.device if first is not None else self._device

    def _owner(self, name: str) -> tuple[nn.Module, str]:
        """The module that holds `name` in the tree, created on the way."""
        *path, leaf = name.split(".")
        node: nn.Module = self
        for part in path:
            child = node._modules.get(part)
            if child is None:
                child = Scope()
                node.add_module(part, child)
            node = child
        return node, leaf

    def weight_names(self) -> list[str]:
        """The model's weights this stage holds: trainable and frozen (not buffers)."""
        return [
            p.name for p in map(Param._make, self.PARAMS) if p.trainable or p.name in self.FROZEN
        ]

    def named_tensors(self) -> dict[str, torch.Tensor]:
        return dict(self.named_parameters()) | dict(self.named_buffers())

    @torch.no_grad()
    def reset_parameters(self, seed: int = 0) -> None:
        """Deterministic per name: the same weights however the model is partitioned."""
        tensors = self.named_tensors()
        buffers = _read_buffers(self.BUFFERS_FILE)
        for name, shape, _, trainable, _ in self.PARAMS:
            t = tensors[name]
            if trainable or name in self.FROZEN:
                t.copy_(initial_value(name, t.shape, t.dtype, seed))
            else:
                t.copy_(buffers[name] if name in buffers else torch.zeros(tuple(shape)))

    @torch.no_grad()
    def load_weights(self, folder) -> list[str]:
        """Copy this stage's tensors (by name or alias) from the *.safetensors files of `folder`.

        Only the tensors this stage needs are read. Returns the names found; a weight
        (trainable or frozen) missing from the checkpoint is an error (training random
        weights by accident is worse than stopping).
        """
        from safetensors import safe_open

        tensors = self.named_tensors()
        wanted = {name: checkpoint_keys(name, aliases) for name, _, _, _, aliases in self.PARAMS}
        found: dict[str, str] = {}
        files = weight_files(folder)
        if not files:
            where = f"${WEIGHTS_ENV}" if os.environ.get(WEIGHTS_ENV) else "the model folder"
            raise PipelineConfigError(
                f"stage {self.STAGE}: {where} {folder} holds no *.safetensors weights; give a "
                f"folder that does (${WEIGHTS_ENV}), or put the model's weights back"
            )
        for path in files:
            try:
                with safe_open(str(path), framework="pt", device="cpu") as f:
                    keys = set(f.keys())
                    for name, names in wanted.items():
                        key = next((k for k in names if k in keys), None)
                        if name in found or key is None:
                            continue
                        _copy_checked(self, tensors, name, f.get_tensor(key), f"{path.name}: {key}")
                        found[name] = key
            except PipelineConfigError:
                raise
            except Exception as e:  # noqa: BLE001 - SafetensorError (no OSError), OSError...
                said = " ".join(str(e).split())[:160] or type(e).__name__
                raise PipelineConfigError(
                    f"{path} is not a readable safetensors file ({said}); is it damaged or cut "
                    "short?"
                ) from None
        # LoRA adapters are new: a base model's folder does not hold them.
        missing = [n for n in self.weight_names() if n not in found and not is_adapter(n)]
        if missing and (Path(folder) / "config.json").is_file():
            found.update(_copy_converted(self, folder, files, missing))
            missing = [n for n in missing if n not in found]
        if missing:
            raise PipelineConfigError(
                f"stage {self.STAGE}: {len(missing)} weights are not in {folder} "
                f"(e.g. {missing[0]}); is it the checkpoint of the compiled model?"
            )
        return sorted(found)


def _copy_converted(stage: StageModule, folder, files, names: list[str]) -> dict[str, str]:
    """Weights the checkpoint holds in another form (MoE experts one by one, fused in the
    model), made as transformers makes them when it loads (`models.hf.converted_from_folder`):
    name -> where they came from, for those it makes."""
    from ..models.hf import converted_from_folder

    tensors, found = stage.named_tensors(), {}
    for name, value in converted_from_folder(folder, names, files):
        _copy_checked(stage, tensors, name, value, f"{folder}: {name} as converted")
        found[name] = "converted"
    return found


def _copy_checked(stage: StageModule, tensors: dict, name: str, value, source: str) -> None:
    """`value` (read from `source`) into the stage's tensor `name`, or one sentence on why its
    shape cannot go there."""
    if tuple(value.shape) != tuple(tensors[name].shape):
        raise PipelineConfigError(
            f"{source} has shape {tuple(value.shape)}, stage {stage.STAGE} expects "
            f"{tuple(tensors[name].shape)} for {name}"
        )
    tensors[name].copy_(value)


def import_ops(modules) -> None:
    """Import the modules that define the custom ops a generated stage calls (`torch.ops.ns`
    registers them as they are imported): a package traced from a model whose code calls
    transformers' own ops runs without the model's code being imported otherwise."""
    for name in modules:
        try:
            importlib.import_module(name)
        except ImportError as e:
            raise PipelineConfigError(
                f"the stages call custom ops defined in {name}, which cannot be imported here "
                f"({e}); install what the model was compiled with (transformers: pip install "
                "'ftpipe[hf]')"
            ) from None


def weights_folder(stage) -> str:
    """Where a stage's checkpoint is: $FTPIPE_WEIGHTS (`--weights`), else the model folder it
    was compiled from, where the package expects it. A package compiled from a checkpoint
    that is not there stops: training random weights by accident is worse than stopping."""
    chosen = os.environ.get(WEIGHTS_ENV)
    if chosen or not stage.WEIGHTS_DIR:
        return chosen or ""
    folder = Path(stage.WEIGHTS_DIR)
    if not weight_files(folder):
        raise PipelineConfigError(
            f"the package was compiled from the checkpoint in {os.path.normpath(folder)}, which "
            f"holds no *.safetensors here; pass --weights DIR (the model's folder) or set "
            f"{WEIGHTS_ENV}=DIR"
        )
    return str(folder)


def weight_files(folder) -> list[Path]:
    return sorted(Path(folder).glob("*.safetensors")) if folder else []


_BUFFER_CACHE: dict[str, dict] = {}


def _read_buffers(path) -> dict[str, torch.Tensor]:
    if path is None or not Path(path).is_file():
        return {}
    key = str(path)
    if key not in _BUFFER_CACHE:
        _BUFFER_CACHE[key] = torch.load(key, map_location="cpu", weights_only=True)["tensors"]
    return _BUFFER_CACHE[key]


def run_in_one_process(stages: dict, plan: dict, inputs: dict, backward: bool = True):
    """Chain the stages in one process the way the pipeline does, returning the loss.

    Every received tensor is detached from its sender (gradients then cross stage boundaries
    explicitly, as over a network): forward in stage order, backward in reverse, each stage
    backpropagating the gradients its consumers computed for what it sent (a weight its
    readers used included: the gradient lands in the owner's parameter).
    """
    grad_flows = {t["tensor"]: t["requires_grad"] for t in plan["transfers"]}
    sent: dict[str, torch.Tensor] = {}
    received: dict[int, dict[str, torch.Tensor]] = {}
    outputs: dict[int, dict[str, torch.Tensor]] = {}
    for k in sorted(stages):
        kwargs = {}
        for name in stages[k].INPUTS:
            if name in inputs:
                kwargs[name] = inputs[name]
            else:
                kwargs[name] = sent[name].detach().requires_grad_(grad_flows[name])
        outputs[k] = stages[k](**kwargs)
        received[k] = kwargs
        sent.update(outputs[k])
    loss = outputs[plan["loss_stage"]]["loss"]
    if not backward:
        return loss
    grads: dict[str, torch.Tensor] = {}
    for k in sorted(stages, reverse=True):
        roots, seeds = ([loss], [None]) if k == plan["loss_stage"] else ([], [])
        for n, t in outputs[k].items():  # a sent parameter is a leaf: its .grad accumulates
            if n != "loss" and t.requires_grad and n in grads:
                roots.append(t)
                seeds.append(grads[n])
        if roots:
            torch.autograd.backward(roots, seeds)
        for name, t in received[k].items():
            if name not in inputs and t.grad is not None:
                grads[name] = grads[name] + t.grad if name in grads else t.grad
    return loss
