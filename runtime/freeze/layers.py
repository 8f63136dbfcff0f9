"""PipeTransformer's freeze algorithm: how many bottom layers are frozen after each decision.

    frozen_bound(frozen=8, layers=24, alpha=1/3)            # 13: at most this many after
    next_frozen(frozen=8, norms=[...24 norms...], alpha=1/3)  # eq. 1
    bound_schedule(layers=24, alpha=1/3, decisions=3)       # (8, 13, 16): the fastest it may go
    units = layer_units(param_names)                        # the parameters of each layer
    freezer = FreezeTraining(plan, modules, optimizers, mixed, comm, alpha=1/3, every=100)
    stepper.on_grads = freezer.measure; freezer.after_step(event, step)   # in the run

He et al., "PipeTransformer", ICML'21, §3.1, eq. 1: at the T-th decision (T >= 1,
L_frozen^(0) = 0, alpha in (0, 1)), with g_l the gradient of layer l at that iteration,

    L_frozen^(T) = min(L_frozen^(T-1) + alpha (L - L_frozen^(T-1)),
                       argmin_{l in {L_frozen^(T-1), ..., L}} ||g_l^(T)||)

Layers are numbered from the input, 0 first, so layer l is preceded by l layers: the
gradient term freezes the layers *preceding* the layer of smallest gradient norm (Appendix
B: "freeze all layers preceding the ... layer" of smallest gradient norm, amended by the
bound), and the candidates are the active layers L_frozen^(T-1) ... L-1 (a frozen layer
has no gradient); the first active layer being the smallest freezes nothing more. The bound
is a count of layers: it is rounded down, so at most an alpha fraction of the active layers
is frozen at once. A norm that is not finite (a skipped fp16 step) counts as infinite.

A "layer" is one of the model's repeated blocks (`bert.encoder.layer.7`, `model.layers.7`,
`encoder.block.7`); what precedes the first block (the embeddings) freezes with it, and
what follows the last (the head) never freezes.

In a run (`FreezeTraining`, a synchronous schedule): after every `every` optimizer steps
each rank sums the squared gradients of its layers (before clipping) at that step, the
pipeline's ranks add theirs up (replicas hold the same averaged gradients, so each pipeline
decides alike), and every rank applies the rule: a newly frozen layer's weights stop
training (`requires_grad` off, dropped with their state from the optimizer and from the
replicas' all-reduce). `forced` ({step: layers}) replaces the rule at those steps, for
tests and for replaying a run's decisions. Each decision is recorded (`record`: the run log).
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Sequence

import torch

from ..train.zero import replica_norms

__all__ = [
    "FreezeTraining",
    "bound_schedule",
    "frozen_bound",
    "layer_of",
    "layer_units",
    "next_frozen",
    "parse_freeze_at",
]

_NUMBERED = re.compile(r"^(.*?\.)?(\d+)\.")


def frozen_bound(frozen: int, layers: int, alpha: float) -> int:
    """The upper bound of eq. 1, L_f + alpha (L - L_f), rounded down."""
    if not 0 < alpha < 1:
        raise ValueError(f"alpha must be between 0 and 1 (exclusive), not {alpha}")
    if not 0 <= frozen <= layers:
        raise ValueError(f"{frozen} frozen layers of {layers}")
    # the small margin keeps 8 + (1/3) * 15 = 12.999... from rounding down to 12
    return max(frozen, math.floor(frozen + alpha * (layers - frozen) + 1e-9))


def next_frozen(frozen: int, norms: Sequence[float], alpha: float) -> int:
    """Eq. 1: the frozen count after a decision, from the gradient norm of every layer
    (`norms[l]` for layer l; those of frozen layers are not looked at)."""
    layers = len(norms)
    bound = frozen_bound(frozen, layers, alpha)
    if frozen >= layers:
        return frozen
    active = [(n if math.isfinite(n) else math.inf, k) for k, n in enumerate(norms)][frozen:]
    smallest = min(active)[1]  # ties: the lowest layer
    return max(frozen, min(bound, smallest))


def bound_schedule(layers: int, alpha: float, decisions: int) -> tuple[int, ...]:
    """Frozen counts after decisions 1..`decisions` when the bound is always what limits
    (the gradient term never smaller): the most freezing alpha allows."""
    out, frozen = [], 0
    for _ in range(decisions):
        frozen = frozen_bound(frozen, layers, alpha)
        out.append(frozen)
    return tuple(out)


def layer_of(name: str) -> str | None:
    """`bert.encoder.layer.7.attention.self.query.weight` -> `bert.encoder.layer.7`; None for
    a parameter outside the repeated blocks."""
    m = _NUMBERED.match(name)
    return f"{m.group(1) or ''}{m.group(2)}" if m else None


def layer_units(names: Sequence[str]) -> list[list[str]]:
    """The parameters that freeze with each layer, in the order `names` first reach each
    layer (execution order when `names` is): parameters met before the first layer join
    layer 0, those after the last stay trainable and are in no unit."""
    units: dict[str, list[str]] = {}
    before: list[str] = []
    for name in names:
        key = layer_of(name)
        if key is None:
            if not units:
                before.append(name)
            continue
        units.setdefault(key, []).append(name)
    out = [list(v) for v in units.values()]
    if out:
        out[0] = before + out[0]
    return out


def parse_freeze_at(text: str) -> tuple[int, int]:
    """`--freeze-at 6:2`: after 6 optimizer steps, 2 layers are frozen."""
    try:
        step, layers = (int(x) for x in text.split(":"))
    except ValueError:
        raise ValueError(f"--freeze-at takes STEP:LAYERS (e.g. 6:2), not {text!r}") from None
    if step < 1 or layers < 1:
        raise ValueError(f"--freeze-at {text}: the step and the layers must be at least 1")
    return step, layers


class FreezeTraining:
    """This rank's part of freeze training (see the module docstring)."""

    def __init__(
        self,
        plan: dict,
        modules: dict,
        optimizers: dict,
        mixed,
        comm,
        *,
        alpha: float | None,
        every: int,
        forced: dict[int, int] | None = None,
        record: Callable[..., None] | None = None,
    ):
        self.units = layer_units([p["name"] for p in plan["params"]])
        if not self.units:
            raise ValueError("freeze training needs a model of numbered layers; this has none")
        self.unit_of = {name: i for i, u in enumerate(self.units) for name in u}
        self.modules, self.optimizers, self.mixed, self.comm = modules, optimizers, mixed, comm
        self.alpha, self.every, self.forced = alpha, every, dict(forced or {})
        self.record = record
        self.frozen = 0
        self.grad_sync = None  # with replicas: their all-reduce leaves frozen weights out
        self.decisions: list[dict] = []
        self._norms: dict[int, torch.Tensor] = {}

    def due(self, step: int) -> bool:
        """Is a decision taken after step `step` (0-based)?"""
        done = step + 1
        return done in self.forced or (self.alpha is not None and done % self.every == 0)

    def measure(self, ev) -> None:
        """At a step's gradients: the squared norm of each layer's gradient on this rank."""
        if not self.due(ev.step):
            return
        # Row 0: the gradients every replica holds alike; row 1: this replica's slices of
        # sharded stages' (`zero`), which the sum over the replicas completes.
        sq = torch.zeros(2, len(self.units), dtype=torch.float64)
        for s in ev.stages:
            row = sq[1 if s in self.mixed.shards else 0]
            for name, t in self.mixed.stepped(s):
                unit = self.unit_of.get(name)
                if unit is not None and t.grad is not None:
                    row[unit] += t.grad.detach().double().pow(2).sum().cpu()
        self._norms[ev.step] = (sq, ev.ranks)

    def after_step(self, ev, step: int) -> None:
        """After the step's update: decide, and freeze what the decision adds."""
        if not self.due(step):
            return
        sq, ranks = self._norms.pop(step)
        whole, part = sq.to(self.comm.device)
        what = "the layers' gradient norms"
        total = replica_norms(self.comm, whole, part, ranks, self.mixed.sharded_over, what)
        norms = total.cpu().sqrt().tolist()
        done = step + 1
        before = self.frozen
        if done in self.forced:
            new, how = max(before, min(self.forced[done], len(self.units) - 1)), "forced"
        else:
            new, how = next_frozen(before, norms, self.alpha), "rule"
        bound = frozen_bound(before, len(self.units), self.alpha) if self.alpha else None
        if new > before:
            self._freeze(before, new)
        row = {"step": done, "frozen": new, "before": before, "layers": len(self.units),
               "by": how, "bound": bound, "norms": norms}  # fmt: skip
        self.decisions.append(row)
        if self.record is not None:
            self.record(row)

    def start_frozen(self, layers: int) -> None:
        """Freeze the bottom `layers` at once: a run going on on another plan
        (`ftpipe_runtime.freeze.elastic`) whose earlier decisions froze them."""
        if layers > self.frozen:
            self._freeze(self.frozen, layers)

    def _freeze(self, before: int, upto: int) -> None:
        names = {n for u in self.units[before:upto] for n in u}
        for s, opt in self.optimizers.items():
            gone = {id(t) for t in self.mixed.freeze(s, names)}
            if opt is None or not gone:
                continue
            if s in self.mixed.shards:  # laid out again over what still trains
                opt.relayout()
                continue
            for group in opt.param_groups:
                group["params"] = [t for t in group["params"] if id(t) not in gone]
            for t in [t for t in opt.state if id(t) in gone]:
                del opt.state[t]
        if self.grad_sync is not None:
            self.grad_sync.refresh()
        self.frozen = upto
