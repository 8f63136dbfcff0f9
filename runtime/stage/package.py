"""This rank's stage modules: built from the generated classes, started from one set of weights.

modules = build_stages(topo, {0: Stage0, 1: Stage1}, rank, device)   # only this rank's
load_init(modules, "weights.pt", plan)     # optional: a state dict by canonical name
package = import_package("out/t5_tiny_pipeline")   # a generated package, by its folder
"""

from __future__ import annotations

import importlib.util
import itertools
import sys
from pathlib import Path
from types import ModuleType

import torch
from torch import nn

from ..checkpoint.files import load_pickled
from ..errors import PipelineConfigError

__all__ = ["build_stages", "import_package", "load_init"]

_loaded = itertools.count()


def import_package(folder, prefix: str = "_ftpipe_generated") -> ModuleType:
    """Import a generated package from its folder under a unique module name, so that several
    packages of the same name (one per test, the elastic plans of one run) live in one process."""
    folder = Path(folder).resolve()
    name = f"{prefix}_{next(_loaded)}_{folder.name}"
    spec = importlib.util.spec_from_file_location(
        name, folder / "__init__.py", submodule_search_locations=[str(folder)]
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def build_stages(topo, classes: dict, rank: int, device, dtype=None) -> dict[int, nn.Module]:
    """A stage class is called as `cls(device=..., dtype=dtype, materialize=True)` (`dtype`:
    the compute dtype, None: the traced one); a module instance is taken as it is (moved)."""
    classes = {int(k): v for k, v in classes.items()}
    modules = {}
    for s in topo.stages_on(rank):
        if s not in classes:
            raise PipelineConfigError(f"no class for stage {s}; the package and plan disagree")
        made = classes[s]
        module = (
            made.to(device)
            if isinstance(made, nn.Module)
            else made(device=str(device), dtype=dtype, materialize=True)
        )
        _check_signature(topo, s, module)
        modules[s] = module.train()
    return modules


def _check_signature(topo, s: int, module) -> None:
    want_in = set(topo.model_inputs[s]) | set(topo.inputs[s])
    have_in = getattr(module, "INPUTS", None)
    if have_in is not None and set(have_in) != want_in:
        raise PipelineConfigError(
            f"stage {s} takes {sorted(have_in)} but the plan gives it {sorted(want_in)}"
        )
    want_out = set(topo.outputs[s]) | ({"loss"} if s == topo.loss_stage else set())
    have_out = getattr(module, "OUTPUTS", None)
    if have_out is not None and not want_out <= set(have_out):
        raise PipelineConfigError(
            f"stage {s} makes {sorted(have_out)} but the plan expects {sorted(want_out)}"
        )


def load_init(modules: dict, path: str, plan: dict) -> None:
    """Copy every stage tensor from a state dict file (.pt or .safetensors), by name or alias."""
    try:
        if str(path).endswith(".safetensors"):
            from safetensors.torch import load_file

            state = load_file(path)
        else:
            state = load_pickled(path)
    except FileNotFoundError:
        raise PipelineConfigError(f"--init {path}: no such file") from None
    except Exception as e:  # noqa: BLE001 - damaged, not a state dict, or a blocked pickle
        raise PipelineConfigError(
            f"--init {path} is not a state dict of tensors ({type(e).__name__}); save one with "
            "torch.save(model.state_dict(), path)"
        ) from None
    if not isinstance(state, dict):
        raise PipelineConfigError(f"--init {path} holds a {type(state).__name__}, not a state dict")
    aliases = {p["name"]: tuple(p.get("aliases", ())) for p in plan.get("params", ())}
    for s, module in modules.items():
        trainable = {n for n, p in module.named_parameters() if p.requires_grad}
        own = module.state_dict()
        found = {}
        for name in own:
            key = next((k for k in (name, *aliases.get(name, ())) if k in state), None)
            if key is not None:
                value = state[key]
                if not isinstance(value, torch.Tensor) or value.shape != own[name].shape:
                    shape = tuple(value.shape) if isinstance(value, torch.Tensor) else "no tensor"
                    raise PipelineConfigError(
                        f"--init {path}: {key} has shape {shape}, stage {s} expects "
                        f"{tuple(own[name].shape)} for {name}; is it this model's checkpoint?"
                    )
                found[name] = value
        missing = sorted(trainable - set(found))
        if missing:
            raise PipelineConfigError(
                f"{path} lacks {len(missing)} weights of stage {s} (e.g. {missing[0]})"
            )
        module.load_state_dict(found, strict=False)
