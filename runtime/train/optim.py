"""Optimizers by name, the learning-rate schedule, and gradient norms for clipping.

    opt = make_optimizer("adamw", params, lr=1e-3)
    lr_at(step=5, base=1e-3, steps=100, warmup=10, decay="linear")
    sq = squared_norm(grads); coef = clip_coef(total_sq, max_norm=1.0)

Adafactor is torch's own (`torch.optim.Adafactor`, torch >= 2.5); on an older torch it is
refused with a message rather than silently replaced by something else.
"""

from __future__ import annotations

import torch

from ..errors import PipelineConfigError


def _sgd(params, lr):
    return torch.optim.SGD(params, lr=lr)


def _fused(factory, params, lr):
    """torch's fused kernel where the parameters' device and dtype have one: one pass over
    each tensor instead of a dozen (a 51 MB embedding's AdamW step: 11 ms against 52 on one
    CPU thread; a step within 1e-8 of the loop's). Otherwise the loop, same rule."""
    try:
        return factory(params, lr=lr, fused=True)
    except (RuntimeError, ValueError):  # no fused kernel for this device or dtype
        return factory(params, lr=lr)


def _adam(params, lr):
    return _fused(torch.optim.Adam, params, lr)


def _adamw(params, lr):
    return _fused(torch.optim.AdamW, params, lr)


def _adafactor(params, lr):
    factory = getattr(torch.optim, "Adafactor", None)
    if factory is None:
        raise PipelineConfigError(
            f"torch {torch.__version__} has no Adafactor; upgrade torch (>= 2.5) or pick "
            "--optimizer adamw"
        )
    return factory(params, lr=lr)


OPTIMIZERS = {"sgd": _sgd, "adam": _adam, "adamw": _adamw, "adafactor": _adafactor}


def make_optimizer(name: str, params, lr: float) -> torch.optim.Optimizer | None:
    """An optimizer over `params`, or None when there is nothing to train."""
    try:
        factory = OPTIMIZERS[name.lower()]
    except KeyError:
        raise PipelineConfigError(
            f"unknown optimizer {name!r}; choose from {', '.join(OPTIMIZERS)}"
        ) from None
    params = [p for p in params if p.requires_grad]
    return factory(params, lr) if params else None


def _constant(step: int, steps: int, warmup: int) -> float:
    return 1.0


def _linear(step: int, steps: int, warmup: int) -> float:
    """Down from 1 to 1/(steps - warmup) at the last step, never 0 (that step would be lost)."""
    return max(steps - step, 1) / max(steps - warmup, 1)


DECAYS = {"linear": _linear, "constant": _constant}


def lr_at(step: int, base: float, steps: int, warmup: int = 0, decay: str = "linear") -> float:
    """Learning rate of optimizer step `step` (0-based): linear warm-up, then `decay`."""
    if decay not in DECAYS:
        raise PipelineConfigError(f"unknown decay {decay!r}; choose from {', '.join(DECAYS)}")
    if step < warmup:
        return base * (step + 1) / warmup
    return base * DECAYS[decay](step, steps, warmup)


def squared_norm(grads) -> torch.Tensor:
    """Sum of squares of the gradients, in float32 (a 0-d tensor; 0 when there are none)."""
    total = torch.zeros((), dtype=torch.float32)
    for g in grads:
        if g is not None:
            total = total.to(g.device) + g.detach().float().pow(2).sum()
    return total


def clip_coef(total_sq: torch.Tensor, max_norm: float) -> torch.Tensor:
    """The factor `torch.nn.utils.clip_grad_norm_` would scale the gradients by."""
    return torch.clamp(max_norm / (total_sq.sqrt() + 1e-6), max=1.0)
