"""`python -m <package> --check`: the generated stages against the original model.

    result = check(package.STAGES, package.load_plan(), seed=0)   # CheckResult(ok=True, ...)
    main(["--json"], package.STAGES, package.load_plan, prog="t5_tiny_pipeline --check")

All stages run chained in one process on the CPU (received tensors detached, gradients passed
back by hand, as the pipeline does), fed synthetic inputs of the plan's shapes with a fixed
seed (micro-batch 0 of the runtime's synthetic data, what the compiler traced with). The
original model (transformers, or the user's function) runs eagerly on the same
inputs and weights, dropout off. Loss and every parameter's gradient are compared; each
parameter lives in one stage (a weight other stages read gets their gradients back there).
"""

from __future__ import annotations

import importlib
import json
import sys
from dataclasses import asdict, dataclass

import torch

from ..errors import PipelineConfigError
from ..models import synthetic_batch
from ..stage.api import run_in_one_process, weight_files, weights_folder
from .config import CheckConfig

__all__ = ["CheckResult", "check", "main", "synthetic_inputs"]

LOSS_RTOL = 1e-5
GRAD_RTOL = 1e-5  # of the largest gradient entry of the same parameter
GRAD_ATOL = 1e-6  # of the largest gradient entry of the whole model


@dataclass(frozen=True)
class CheckResult:
    loss: float
    reference_loss: float
    loss_abs_diff: float
    loss_rel_diff: float
    grad_max_abs_diff: float
    grad_max_rel_diff: float
    worst_param: str
    params_compared: int
    ok: bool

    def to_json(self) -> dict:
        return asdict(self)


def synthetic_inputs(plan: dict, seed: int = 0) -> dict:
    """Micro-batch 0 of the runtime's synthetic data: what the compiler traced with."""
    return synthetic_batch(plan["model"], index=0, seed=seed)


def reference_model(plan: dict, seed: int = 0):
    """(model, forward(inputs) -> loss): the original model, randomly initialised, dropout off."""
    model = plan["model"]
    torch.manual_seed(seed)
    if model.get("model_kind") == "function":
        module, _, function = model["spec"].partition(":")
        net, _ = getattr(importlib.import_module(module), function)()
        return net, lambda inputs: net(*inputs.values())
    from ..models.hf import build_model, loss_of
    from ..models.lora import wrap

    net = build_model(model["config"], model["hf_class"], "cpu", dropout=0.0, seed=seed)
    net = wrap(net, model.get("lora"))  # the adapters the package was compiled with
    frozen = {n for p in plan["params"] if p.get("frozen") for n in (p["name"], *p["aliases"])}
    for name, p in net.named_parameters(remove_duplicate=False):
        if name in frozen:  # --freeze: the same weights get no gradient
            p.requires_grad_(False)
    return net, lambda inputs: loss_of(net, inputs)


def _named(net) -> dict:
    return dict(net.named_parameters(remove_duplicate=False))


def _lookup(tensors: dict, name: str, aliases):
    return next((tensors[n] for n in (name, *aliases) if n in tensors), None)


@torch.no_grad()
def copy_weights(net, stages: dict) -> None:
    """Give the stages the reference model's weights, by name (tied ones by alias)."""
    ref = _named(net)
    for stage in stages.values():
        own = dict(stage.named_parameters())
        for name, _, _, trainable, aliases in stage.PARAMS:
            if trainable or name in stage.FROZEN:
                source = _lookup(ref, name, aliases)
                if source is None:
                    raise KeyError(f"the original model has no parameter {name}")
                own[name].copy_(source)


@torch.no_grad()
def load_reference_weights(net, folder) -> None:
    """The checkpoint as transformers loads it (names it renames, tensors it converts)."""
    loaded = type(net).from_pretrained(folder, config=net.config)
    net.load_state_dict(loaded.state_dict())


def check(stage_classes: dict, plan: dict, seed: int = 0) -> CheckResult:
    """All stages chained in one CPU process against the original model, as the doc says."""
    net, forward = reference_model(plan, seed)
    # In fp32 whatever the package was compiled for: its 16-bit casts follow the stage's dtype,
    # so this checks the code, exactly, against the original model in fp32.
    stages = {k: cls(device="cpu", dtype=torch.float32) for k, cls in stage_classes.items()}
    folder = weights_folder(stages[0])
    if weight_files(folder) and not plan["model"].get("lora"):  # LoRA: the stages' copied
        load_reference_weights(net, folder)  # the stages loaded theirs when they were built
    else:
        copy_weights(net, stages)
    for stage in stages.values():
        stage.eval()  # dropout off: the generated code passes self.training as its train flag
    inputs = synthetic_inputs(plan, seed)
    reference_loss = forward(inputs)
    reference_loss.backward()
    loss = run_in_one_process(stages, plan, inputs)
    max_abs, max_rel, worst, compared, grads_ok = compare_gradients(stages, net)
    ref_value, value = reference_loss.item(), loss.item()
    loss_abs = abs(value - ref_value)
    loss_rel = loss_abs / max(abs(ref_value), 1e-30)
    return CheckResult(
        loss=value,
        reference_loss=ref_value,
        loss_abs_diff=loss_abs,
        loss_rel_diff=loss_rel,
        grad_max_abs_diff=max_abs,
        grad_max_rel_diff=max_rel,
        worst_param=worst,
        params_compared=compared,
        ok=loss_rel <= LOSS_RTOL and grads_ok,
    )


def compare_gradients(stages: dict, net):
    """(max abs diff, max diff relative to the parameter's largest gradient, worst parameter,
    parameters compared, all close). Close: diff <= GRAD_RTOL * that parameter's largest
    gradient + GRAD_ATOL * the largest gradient of the model (gradients that are zero in
    exact arithmetic, like attention key biases, are rounding noise in both)."""
    grads: dict = {}
    aliases: dict = {}
    twice = []
    for stage in stages.values():
        own = dict(stage.named_parameters())
        for name, _, _, trainable, names in stage.PARAMS:
            if trainable:
                twice += [name] if name in aliases else []
                aliases[name] = names
                grad = own[name].grad
                if grad is not None:
                    grads[name] = grad
    ref = _named(net)
    pairs = {}
    for name, names in aliases.items():
        expected = _lookup(ref, name, names)
        want = expected.grad if expected.grad is not None else torch.zeros_like(expected)
        pairs[name] = (grads.get(name, torch.zeros_like(want)), want)
    scale = max((float(w.abs().max()) for _, w in pairs.values() if w.numel()), default=0.0)
    max_abs = max_rel = excess = 0.0
    worst = ""
    for name, (got, want) in pairs.items():
        if not want.numel():
            continue
        diff = float((got - want).abs().max())
        own_scale = float(want.abs().max())
        max_abs = max(max_abs, diff)
        max_rel = max(max_rel, diff / own_scale if own_scale else (0.0 if diff == 0 else 1.0))
        e = diff / (GRAD_RTOL * own_scale + GRAD_ATOL * scale + 1e-30)
        if e > excess or not worst:
            worst, excess = name, e
    held = {n for name, names in aliases.items() for n in (name, *names)}
    unheld = [n for n, p in ref.items() if p.grad is not None and n not in held]
    if unheld:
        return max_abs, max_rel, f"{unheld[0]} (held by no stage)", len(pairs), False
    if twice:
        return max_abs, max_rel, f"{twice[0]} (held by two stages)", len(pairs), False
    return max_abs, max_rel, worst, len(pairs), excess <= 1.0


def main(argv, stage_classes: dict, load_plan, prog: str = "--check") -> int:
    """The `--check` command line (its options: `config.CheckConfig`); `load_plan()` returns
    the package's plan."""
    config = CheckConfig.parse(argv, prog=prog)
    try:  # a damaged plan.json (`topology.read_plan`'s sentence), weights that do not fit...
        result = check(stage_classes, load_plan(), config.seed)
    except PipelineConfigError as e:
        print(f"ftpipe: {e}", file=sys.stderr)
        return 1
    if config.json:
        print(json.dumps(result.to_json(), indent=2))
    else:
        print(
            f"loss {result.loss:.8g}, original model {result.reference_loss:.8g}: "
            f"abs diff {result.loss_abs_diff:.3g}, rel diff {result.loss_rel_diff:.3g}"
        )
        print(
            f"gradients of {result.params_compared} parameters: max abs diff "
            f"{result.grad_max_abs_diff:.3g}, max rel diff {result.grad_max_rel_diff:.3g} "
            f"({result.worst_param})"
        )
        print(
            "OK: the stages compute what the original model computes"
            if result.ok
            else f"MISMATCH (tolerance: loss {LOSS_RTOL:g}, gradients {GRAD_RTOL:g} relative, "
            f"{GRAD_ATOL:g} of the largest gradient absolute)"
        )
    return 0 if result.ok else 1
