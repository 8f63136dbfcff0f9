"""Optimizers by name, the learning-rate schedules, and gradient norms for clipping.

    opt = make_optimizer("adamw", params, lr=1e-3, hyper=Hyper(weight_decay=0.01))
    lr_at(step=5, base=1e-3, steps=100, warmup=10, decay="cosine")
    sq = squared_norm(grads); coef = clip_coef(total_sq, max_norm=1.0)

The defaults are the HuggingFace Trainer's (`Hyper`): no weight decay, betas (0.9, 0.999),
epsilon 1e-8; with weight decay, tensors of one dimension (biases, LayerNorm and RMSNorm
weights) get none, as the Trainer exempts biases and norms. The schedules (`DECAYS`) are
transformers' `get_*_schedule_with_warmup` formulas: during warm-up step k (0-based) runs at
lr * k / warmup (the first at 0).

Adafactor is torch's own (`torch.optim.Adafactor`, torch >= 2.5); on an older torch it is
refused with a message rather than silently replaced by something else.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..errors import PipelineConfigError, pick

__all__ = [
    "DECAYS",
    "OPTIMIZERS",
    "Hyper",
    "Optimizer",
    "clip_coef",
    "lr_at",
    "make_optimizer",
    "param_groups",
    "squared_norm",
    "state_bytes",
]


@dataclass(frozen=True)
class Hyper:
    """The optimizer's settings besides the learning rate (the Trainer's defaults)."""

    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8


def param_groups(params, weight_decay: float, decays=None) -> list[dict]:
    """`params` in optimizer groups: with weight decay, the tensors of one dimension (biases,
    norm weights) in a group of their own without it. `decays(p)`: whether `p` is decayed,
    where its own shape does not say (a shard's slice of a weight: `zero`)."""
    if not weight_decay:
        return [{"params": params, "weight_decay": 0.0}]
    decays = decays or (lambda p: p.ndim >= 2)
    decayed = [p for p in params if decays(p)]
    exempt = [p for p in params if not decays(p)]
    groups = [{"params": decayed, "weight_decay": weight_decay}]
    groups.append({"params": exempt, "weight_decay": 0.0})
    return [g for g in groups if g["params"]]


def _sgd(groups, lr, hyper: Hyper):
    return torch.optim.SGD(groups, lr=lr)


def _fused(factory, groups, lr, **kwargs):
    """torch's fused kernel where the parameters' device and dtype have one: one pass over
    each tensor instead of a dozen (a 51 MB embedding's AdamW step: 11 ms against 52 on one
    CPU thread; a step within 1e-8 of the loop's). Otherwise the loop, same rule."""
    try:
        return factory(groups, lr=lr, fused=True, **kwargs)
    except (RuntimeError, ValueError):  # no fused kernel for this device or dtype
        return factory(groups, lr=lr, **kwargs)


def _adam(groups, lr, hyper: Hyper):
    return _fused(torch.optim.Adam, groups, lr, betas=hyper.betas, eps=hyper.eps)


def _adamw(groups, lr, hyper: Hyper):
    return _fused(torch.optim.AdamW, groups, lr, betas=hyper.betas, eps=hyper.eps)


def _adafactor(groups, lr, hyper: Hyper):
    factory = getattr(torch.optim, "Adafactor", None)
    if factory is None:
        raise PipelineConfigError(
            f"torch {torch.__version__} has no Adafactor; upgrade torch (>= 2.5) or pick "
            "--optimizer adamw"
        )
    return factory(groups, lr=lr)  # its own epsilons and decay rate: no betas


def _moments(shape: tuple[int, ...]) -> int:  # Adam's two moments, each as the parameter
    return 2 * math.prod(shape)


def _factored(shape: tuple[int, ...]) -> int:
    """Adafactor's second moment: a row and a column vector for each matrix of the last two
    dimensions (torch keeps one pair per leading index), else whole."""
    if len(shape) < 2:
        return math.prod(shape)
    return math.prod(shape[:-2]) * (shape[-2] + shape[-1])


@dataclass(frozen=True)
class Optimizer:
    """An update rule: how the runtime makes it, and the state it keeps per parameter of
    `shape` (elements, the step counters left out): what the compiler's memory model counts."""

    make: object  # (groups, lr, Hyper) -> torch.optim.Optimizer
    state_elements: object  # shape -> int


OPTIMIZERS = {
    "sgd": Optimizer(_sgd, lambda shape: 0),
    "adam": Optimizer(_adam, _moments),
    "adamw": Optimizer(_adamw, _moments),
    "adafactor": Optimizer(_adafactor, _factored),
}


def make_optimizer(
    name: str, params, lr: float, hyper: Hyper | None = None, decays=None
) -> torch.optim.Optimizer | None:
    """An optimizer over `params`, or None when there is nothing to train (`decays`: as
    `param_groups`)."""
    factory = pick(OPTIMIZERS, name.lower(), "optimizer").make
    hyper = hyper or Hyper()
    params = [p for p in params if p.requires_grad]
    if not params:
        return None
    return factory(param_groups(params, hyper.weight_decay, decays), lr, hyper)


def state_bytes(optimizer) -> int:
    """Bytes of the tensors an optimizer keeps per parameter (AdamW: its two moments)."""
    if optimizer is None:
        return 0
    return sum(
        v.nbytes for state in optimizer.state.values() for v in state.values() if torch.is_tensor(v)
    )


# Each schedule: the factor of the base rate at optimizer step k (0-based) of `steps`, after
# `warmup` steps of linear warm-up (transformers' lr_lambda of the same name, the warm-up
# included); `fraction`: the part of the steps WSD decays over.
def _warmup(k: int, warmup: int) -> float:
    return k / max(1, warmup)


def _constant(k: int, steps: int, warmup: int, fraction: float) -> float:
    """get_constant_schedule_with_warmup."""
    return _warmup(k, warmup) if k < warmup else 1.0


def _linear(k: int, steps: int, warmup: int, fraction: float) -> float:
    """get_linear_schedule_with_warmup: down to 0 at `steps` (the last step at 1/(steps -
    warmup))."""
    if k < warmup:
        return _warmup(k, warmup)
    return max(0.0, (steps - k) / max(1, steps - warmup))


def _cosine(k: int, steps: int, warmup: int, fraction: float) -> float:
    """get_cosine_schedule_with_warmup (half a cosine wave, num_cycles 0.5)."""
    if k < warmup:
        return _warmup(k, warmup)
    progress = (k - warmup) / max(1, steps - warmup)
    return max(0.0, 0.5 * (1.0 + math.cos(math.pi * 0.5 * 2.0 * progress)))


def wsd_decay_steps(steps: int, warmup: int, fraction: float) -> int:
    """The steps WSD decays over: `fraction` of the run, rounded, within what warm-up leaves."""
    return max(0, min(steps - warmup, round(fraction * steps)))


def _wsd(k: int, steps: int, warmup: int, fraction: float) -> float:
    """get_wsd_schedule with decay_type "linear": warm-up, the peak, then down to 0 over the
    last `fraction` of the steps."""
    if k < warmup:
        return _warmup(k, warmup)
    decay = wsd_decay_steps(steps, warmup, fraction)
    stable = steps - warmup - decay
    if k < warmup + stable:
        return 1.0
    if k < steps:
        return max(0.0, 1.0 - (k - warmup - stable) / max(1, decay))
    return 0.0


DECAYS = {"constant": _constant, "linear": _linear, "cosine": _cosine, "wsd": _wsd}


def lr_at(
    step: int,
    base: float,
    steps: int,
    warmup: int = 0,
    decay: str = "linear",
    fraction: float = 0.1,
) -> float:
    """Learning rate of optimizer step `step` (0-based) of `steps`: linear warm-up over
    `warmup` steps, then `decay` (a name of DECAYS; `fraction`: WSD's decaying part)."""
    schedule = pick(DECAYS, decay, "learning-rate schedule")
    return base * schedule(step, steps, warmup, fraction)


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
