"""Training precision: what the stages compute in, and what the optimizer keeps.

    p = get_precision("bf16")              # Precision(compute="bfloat16", master=True, ...)
    p.bytes_per_element()                  # {"weight": 2, "grad": 4, "master": 4, "state": 4}
    mixed = MixedPrecision(p, modules, traced="bfloat16")   # this rank's stages
    mixed.trainable(stage)                 # what the optimizer steps and clipping measures
    mixed.add_grad(weight, g)              # a gradient made outside autograd (W): into its master
    loss * mixed.loss_scale / m            # fp16: backward of the scaled loss
    ok = mixed.unscale_and_check(grads, total_norm_sq)   # False: overflow, skip the step
    mixed.after_step(stage)                # master -> the stage's 16-bit weights
    MixedPrecision(p, modules, offload=HostOffload(device))   # --offload-optimizer (`offload`)
    MixedPrecision(p, modules, offload=host, offloaded={1})   # only stage 1's (the plan's choice)
    MixedPrecision(p, modules, sharded={2})   # stage 2's masters sharded (`zero`): mixed.shards

| name | stages compute in | optimizer steps | bytes per trainable element |
| --- | --- | --- | --- |
| fp32 | float32 | the weights | 4 weight + 4 gradient + state in fp32 |
| bf16 | bfloat16 | fp32 master copies; gradients summed in fp32 | 2 + 4 + 4 master + fp32 state |
| fp16 | float16, dynamic loss scaling | as bf16 | 2 + 4 + 4 master + fp32 state |
| bf16-pure | bfloat16 | the bf16 weights themselves | 2 + 2 + bf16 state: half the memory; small updates round away |

Under mixed precision every gradient of a 16-bit weight is added into the fp32 master's as soon
as it is made, and the 16-bit one freed, so micro-batches accumulate in fp32 (as DeepSpeed's
and Megatron's bf16 optimizers do). Gradients come in two ways and land alike: autograd's
accumulation into the weight (a hook on it), and `add_grad` for those made outside it (a
split backward's weight pass, a set-aside weight version's backward: the executor's). Each
arrival then calls `on_grad(stage, name)`: the replicas' all-reduce (`replicas.GradSync`),
which sums what the optimizer steps, the masters' gradients, in fp32. The masters start from
the stages' 16-bit weights (a checkpoint loaded at the compute dtype, as
`from_pretrained(dtype=...)` loads it); a resumed run takes them from its checkpoint, which
holds them. A weight traced in fp32 (T5's `wo` under fp16: transformers'
`_keep_in_fp32_modules`) stays fp32 and is its own master. With `offload` (--offload-optimizer,
`offload.HostOffload`) every trainable weight, fp32 ones included, of the stages `offloaded`
(default: all) has its master on the host, where its gradients are summed (or, its stage in
the offload's `on_device`, summed on the device and copied once a step) and the optimizer
steps it; `settle(stage)` at the stage's step waits for the gradients' copies. The other
stages keep theirs beside their weights, as without offload. A stage in `sharded`
(--shard-optimizer: `zero`) keeps its masters in its `ShardedOptimizer` (`shards[stage]`),
1/d of them per replica: a 16-bit weight's master here is a gradient-only stand-in (its fp32
gradient sums here, it holds no values), `stepped` is the replica's slices, and `after_step`
all-gathers them into the weights.

fp16's overflow check is global: the squared gradient norm every synchronous step sums over
all ranks (the one collective of the step) is inf or nan on every rank when any gradient
anywhere overflowed, so every stage skips that step and halves the scale together; after
`growth_interval` good steps the scale doubles. `FTPIPE_INJECT_INF=stage:step` puts an inf
into a gradient of that stage at that step, for tests of exactly this.
"""

from __future__ import annotations

import contextlib
import os
import weakref
from dataclasses import dataclass

import torch

from ..errors import PipelineConfigError, pick

__all__ = [
    "PRECISIONS",
    "LossScale",
    "MixedPrecision",
    "Precision",
    "add_grad",
    "add_into",
    "for_run",
    "get_precision",
    "plan_in",
    "runnable",
]


@dataclass(frozen=True)
class Precision:
    name: str
    compute: str  # the stages' weights, activations and messages
    master: bool  # fp32 master weights, fp32 gradient sums and fp32 optimizer state
    loss_scaling: bool = False
    doc: str = ""

    @property
    def dtype(self) -> torch.dtype:
        return getattr(torch, self.compute)

    def bytes_per_element(self) -> dict[str, int]:
        """Bytes each trainable element costs: weight, its gradient, a master copy, and each
        optimizer-state element."""
        weight = torch.empty((), dtype=self.dtype).element_size()
        kept = 4 if self.master else weight
        return {"weight": weight, "grad": kept, "master": 4 if self.master else 0, "state": kept}


PRECISIONS = {
    p.name: p
    for p in (
        Precision("fp32", "float32", master=False, doc="fp32 weights, gradients and state"),
        Precision("bf16", "bfloat16", master=True,
                  doc="bf16 compute, fp32 master weights, gradient sums and optimizer state"),
        Precision("fp16", "float16", master=True, loss_scaling=True,
                  doc="fp16 compute with dynamic loss scaling, fp32 master weights and state"),
        Precision("bf16-pure", "bfloat16", master=False,
                  doc="bf16 weights, gradients and optimizer state: half the memory, less exact"),
    )
}  # fmt: skip


def get_precision(name: str) -> Precision:
    return pick(PRECISIONS, name, "precision")


def runnable(precision: Precision, traced: str) -> str | None:
    """Why a package traced in `traced` cannot run in `precision` (None: it can). The traced
    casts to the compute dtype follow the run's; code traced in fp32 has no such casts to
    follow, and fp16's code differs from bf16's (transformers clamps fp16 activations)."""
    if precision.compute in (traced, "float32"):
        return None
    if traced == "float32":
        return f"it was compiled in fp32; compile it with --dtype {precision.name} to train so"
    return f"it was compiled for {traced}; compile it again with --dtype {precision.name}"


def for_run(plan: dict, name: str, schedule) -> Precision:
    """The precision `name` for this plan and schedule, or one sentence saying why not."""
    precision = get_precision(name)
    why = runnable(precision, plan.get("model", {}).get("compute_dtype", "float32"))
    if why:
        raise PipelineConfigError(f"--dtype {name}: {why}")
    if precision.loss_scaling and not schedule.synchronous:
        from ..schedules import SCHEDULES  # (the schedules import nothing of training)

        sync = ", ".join(n for n, s in SCHEDULES.items() if s.synchronous)
        raise PipelineConfigError(
            f"--dtype fp16 scales the loss by a factor all stages change together at their "
            f"steps, and {schedule.name} does not step them together; use a synchronous "
            f"schedule ({sync}), or bf16"
        )
    return precision


@dataclass
class LossScale:
    """Dynamic loss scaling (fp16): halve on overflow, double after `growth_interval` good steps."""

    scale: float = 2.0**16
    growth_interval: int = 2000
    good_steps: int = 0
    skipped: int = 0

    def update(self, overflow: bool) -> None:
        if overflow:
            self.scale = max(self.scale / 2, 1.0)
            self.good_steps = 0
            self.skipped += 1
            return
        self.good_steps += 1
        if self.good_steps == self.growth_interval:
            self.scale *= 2
            self.good_steps = 0

    def to_json(self) -> dict:
        return dict(self.__dict__)


def plan_in(plan: dict, precision: Precision) -> dict:
    """The plan as this run computes: messages traced in the compute dtype carry the run's."""
    traced = plan.get("model", {}).get("compute_dtype", "float32")
    if traced == precision.compute:
        return plan
    transfers = [
        {**t, "dtype": precision.compute} if str(t["dtype"]) == traced else t
        for t in plan["transfers"]
    ]
    return {**plan, "transfers": transfers}


def _weak_hook(owner: MixedPrecision):
    ref = weakref.ref(owner)

    def accumulated(p: torch.Tensor) -> None:
        alive = ref()
        if alive is not None:
            alive._accumulated(p)

    return accumulated


class MixedPrecision:
    """The trainable tensors of this rank's stages under `precision` (see the module doc)."""

    def __init__(
        self, precision: Precision, modules: dict, offload=None, offloaded=None, sharded=()
    ):
        self.precision = precision
        self.offload = offload  # a HostOffload: the masters on the host; None: beside the weights
        # stage -> its HostOffload, for the stages `offloaded` (None: every stage) when given
        self._host = {s: offload if offloaded is None or s in offloaded else None for s in modules}
        self.shards: dict = {}  # stage -> its ShardedOptimizer (`zero`), which registers itself
        self.sharded_over = 1  # replicas the run's sharded stages are spread over (1: none)
        self.loss_scale = LossScale() if precision.loss_scaling else None
        self.skipped: list[int] = []  # steps skipped for an overflow
        self.say = None  # where a skipped step is reported (rank 0)
        self.inject = _injected()
        self.on_grad = None  # called (stage, name) after each arrival of a weight's gradient
        self._pairs: dict[int, list[tuple[str, torch.nn.Parameter, torch.Tensor]]] = {}
        self._of: dict[int, tuple[int, str, torch.Tensor]] = {}  # id(weight) -> where it sums
        # The hook lives in the parameter's C++ side, which the garbage collector cannot see:
        # a bound method there would keep this object, every master and the optimizer state
        # alive after the run (a cycle never collected: ~20 GB on a GPU for a 1B model).
        hook = _weak_hook(self)
        for s, module in modules.items():
            pairs = []
            for name, p in module.named_parameters():
                if not p.requires_grad:
                    continue
                master = p
                if self._host[s] is not None:
                    kept = torch.float32 if precision.master else p.dtype
                    master = offload.master_of(p, kept)
                elif s in sharded and precision.master and p.dtype != torch.float32:
                    master = _stand_in(p)
                elif precision.master and p.dtype != torch.float32:
                    master = p.detach().float().requires_grad_(True)
                p.register_post_accumulate_grad_hook(hook)
                self._of[id(p)] = (s, name, master)
                pairs.append((name, p, master))
            self._pairs[s] = pairs

    @property
    def stages(self) -> list[int]:
        return list(self._pairs)

    def offloads(self, stage: int) -> bool:
        """Are this stage's masters and optimizer state on the host?"""
        return self._host.get(stage) is not None

    def overlaps(self, stage: int) -> bool:
        """May the stage's step run beside the rank's next actions (`HostOffload.launch`)?
        Offloaded and not sharded (a sharded stage's step ends in an all-gather)."""
        return self._host.get(stage) is not None and stage not in self.shards

    def launch(self, stage: int, step) -> None:
        """The stage's optimizer step `step()` on the host's thread; its weights are updated
        at `land`."""
        self._host[stage].launch(stage, step, self._weights_and_masters(stage))

    def land(self, stage: int, *, reading: bool = False) -> None:
        """Before the stage's weights, masters or optimizer state are read: its overlapped
        step done and its new weights on the device (nothing to do otherwise). `reading`:
        only its weights are (a lagged stage's step lands at its S: `HostOffload.land`)."""
        host = self._host.get(stage)
        if host is not None:
            host.land(stage, reading=reading)

    def finish(self, stage: int) -> None:
        """Before the stage's masters or optimizer state are read (a checkpoint): its
        overlapped step done; its weights stay as they are until it lands."""
        host = self._host.get(stage)
        if host is not None:
            host.finish(stage)

    def lags(self, stage: int) -> bool:
        """Does the stage's offloaded step land at its next S (`--offload-step lagged`)?"""
        host = self._host.get(stage)
        return host is not None and stage in host.lagged

    def defer(self, stage: int) -> None:
        """A resumed lagged stage: its masters' values land at its first step."""
        self._host[stage].defer(stage, self._weights_and_masters(stage))

    def land_all(self) -> None:
        if self.offload is not None:
            self.offload.land_all()

    def _weights_and_masters(self, stage: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return [(p, master) for _, p, master in self._pairs.get(stage, ())]

    def stepping(self, stage: int):
        """Around the stage's optimizer step: offloaded, it is timed as the CPU's step."""
        host = self._host.get(stage)
        return host.clock.phase("cpu_step") if host is not None else contextlib.nullcontext()

    def trainable(self, stage: int) -> list[tuple[str, torch.Tensor]]:
        """(name, tensor whose .grad the optimizer reads): the masters, or the weights (a
        sharded stage: where the gradients sum, before the replicas' reduce-scatter)."""
        return [(n, master) for n, _, master in self._pairs.get(stage, ())]

    def weights(self, stage: int) -> list[tuple[str, torch.Tensor]]:
        """(name, weight the stage computes with) of the trainable ones, as `trainable`."""
        return [(n, p) for n, p, _ in self._pairs.get(stage, ())]

    def stepped(self, stage: int) -> list[tuple[str, torch.Tensor]]:
        """(name, tensor) the optimizer steps and clipping measures: `trainable`'s, or with
        sharded state this replica's slices of them."""
        shard = self.shards.get(stage)
        return shard.named() if shard is not None else self.trainable(stage)

    def master_bytes(self) -> int:
        """Bytes of the masters kept apart from the weights (fp32 copies, host copies,
        shards), as allocated (a sharded stage's stand-ins: one element each)."""
        own = {
            master.untyped_storage().data_ptr(): master.untyped_storage().nbytes()
            for pairs in self._pairs.values()
            for _, p, master in pairs
            if master is not p
        }
        return sum(own.values()) + sum(z.master_bytes() for z in self.shards.values())

    def freeze(self, stage: int, names) -> list[torch.Tensor]:
        """Stop training the weights `names` of a stage (freeze training): they keep no
        gradient; returns the tensors the optimizer held for them (masters or weights)."""
        self.land(stage)
        kept, gone = [], []
        for n, p, master in self._pairs.get(stage, ()):
            if n in names:
                p.requires_grad_(False)
                p.grad = master.grad = None
                if self._host[stage] is not None:
                    self._host[stage].forget(master)
                gone.append(master)
            else:
                kept.append((n, p, master))
        self._pairs[stage] = kept
        return gone

    def stream_gradients(self) -> None:
        """Every offloaded stage's gradients to the host as they are made (none summed on
        the device): the replicas' all-reduce (`replicas.GradSync`) sums the masters'
        gradients as they arrive, during the step's last backward."""
        if self.offload is not None and self.offload.on_device:
            if self.say is not None:
                self.say(
                    "ftpipe: note: with data-parallel replicas the offloaded stages' gradients "
                    "go to the host as they are made (the plan summed some on the GPU)"
                )
            self.offload.on_device = frozenset()

    def multiplier(self) -> float:
        return self.loss_scale.scale if self.loss_scale else 1.0

    def add_grad(self, weight: torch.Tensor, g: torch.Tensor) -> None:
        """A gradient of `weight` made outside autograd's accumulation into it (a split
        backward's weight pass, a set-aside weight version's backward): added where the
        weight's gradients sum, as autograd's hook would add it."""
        s, name, master = self._of[id(weight)]
        if self._host[s] is not None:
            self._host[s].arrive(s, master, g)
        else:
            # The first copied (`g` may be held elsewhere), the next added in place: out of
            # place, a split W's or a set-aside version's sum was a third weight-sized tensor
            # beside the old sum and `g`, which the plan's memory does not count.
            add_grad(master, g)
        self._arrived(s, name)

    def _accumulated(self, p: torch.Tensor) -> None:
        """Autograd's hook, after it added this backward's gradient into `p.grad`."""
        s, name, master = self._of[id(p)]
        if master is not p:
            g, p.grad = p.grad, None
            if self._host[s] is not None:
                self._host[s].arrive(s, master, g)
            else:
                add_grad(master, g)
        self._arrived(s, name)

    def _arrived(self, stage: int, name: str) -> None:
        if self.on_grad is not None:
            self.on_grad(stage, name)

    def checked(self, grads: list, total_sq: torch.Tensor, step: int) -> bool:
        """fp16: undo the loss scale on `grads` and on their summed squared norm (every
        rank's), update the scale; False when the step must be skipped (inf or nan)."""
        if self.loss_scale is None:
            return True
        used = self.loss_scale.scale  # what this step's loss was multiplied by
        overflow = not bool(torch.isfinite(total_sq))
        self.loss_scale.update(overflow)
        if overflow:
            self.skipped.append(step)
            if self.say is not None:
                self.say(
                    f"ftpipe: note: step {step + 1}: the gradients overflowed in fp16 on some rank; "
                    f"every rank skips the step, loss scale {used:g} -> {self.loss_scale.scale:g}"
                )
            return False
        for g in grads:
            g.mul_(1.0 / used)
        total_sq.mul_(1.0 / used**2)
        return True

    def poison(self, stage: int, step: int) -> None:
        """FTPIPE_INJECT_INF: make a gradient of `stage` at `step` infinite."""
        if self.inject == (stage, step):
            grads = [t.grad for _, t in self.stepped(stage) if t.grad is not None]
            if grads:
                grads[0].view(-1)[0] = float("inf")

    def settle(self, stage: int) -> None:
        """At the stage's step, before its gradients are read: offloaded, every copy of them
        to the host summed in (nothing to do otherwise)."""
        if self._host.get(stage) is not None:
            self._host[stage].settle(stage)

    @torch.no_grad()
    def after_step(self, stage: int) -> None:
        """Copy the stepped masters into the stage's 16-bit weights (offloaded: into its
        weights, from the host; sharded: every replica's slices, all-gathered)."""
        if stage in self.shards:
            self.shards[stage].publish()
            return
        if self._host.get(stage) is not None:
            self._host[stage].upload(stage, self._weights_and_masters(stage))
            return
        for _, p, master in self._pairs.get(stage, ()):
            if master is not p:
                p.copy_(master)

    def restore(self, state: dict) -> None:
        """The loss scale a checkpoint's manifest kept (`Saver`: state["loss_scale"])."""
        saved = state.get("loss_scale")
        if self.loss_scale is not None and isinstance(saved, dict):
            self.loss_scale = LossScale(**saved)

    def saved_dtype(self, param: dict, traced: str) -> torch.dtype:
        """The dtype `state_dict` holds a plan parameter in: fp32 for a trainable weight with a
        master, else its traced dtype, which follows the compute dtype if it was that one."""
        dtype = self.precision.compute if param["dtype"] == traced else param["dtype"]
        if self.precision.master and param.get("trainable") and dtype in ("bfloat16", "float16"):
            return torch.float32
        return getattr(torch, dtype)

    def state_dict(self, stage: int, module) -> dict:
        """The stage's tensors for a checkpoint: fp32 masters in place of 16-bit weights;
        weights frozen at compile time left out (a run rebuilds them as it built them:
        `frozen`). A sharded stage's masters are not here: its weights stand for them
        (`ShardedOptimizer.gather` puts the masters together, as `Saver` does)."""
        frozen = set(getattr(module, "FROZEN", ()))
        state = {k: v for k, v in module.state_dict().items() if k not in frozen}
        if stage in self.shards:
            return state
        for name, _, master in self._pairs.get(stage, ()):
            state[name] = master.detach()
        return state

    @torch.no_grad()
    def load(self, stage: int, module, tensors: dict) -> None:
        """A checkpoint's tensors into the stage (cast to its dtypes) and its masters."""
        frozen = set(getattr(module, "FROZEN", ()))
        own = {k: v for k, v in module.state_dict().items() if k not in frozen}
        missing = sorted(set(own) - set(tensors))
        if missing:
            raise KeyError(f"{missing[0]} is not in the checkpoint")
        module.load_state_dict({k: tensors[k].to(own[k].dtype) for k in own}, strict=False)
        if stage in self.shards:  # this replica's slices of the masters
            self.shards[stage].load_masters(tensors)
            return
        for name, p, master in self._pairs.get(stage, ()):
            if master is not p:
                master.copy_(tensors[name])


def add_grad(master: torch.Tensor, g: torch.Tensor) -> None:
    """Add a gradient into a master's: the first one copied (never `g` itself, which its
    maker may reuse: offload's landing buffer), the next added in place straight from its
    dtype (`add_into`: no fp32 temporary of a 16-bit one)."""
    if master.grad is None:
        master.grad = g.to(master.dtype, copy=True)
    else:
        add_into(master.grad, g)


CAST_CHUNK = 1 << 18  # elements: a 1 MiB fp32 temporary, small enough for glibc's heap to reuse


@torch.no_grad()
def add_into(total: torch.Tensor, g: torch.Tensor) -> None:
    """`total += g` in place, with no temporary of `g`'s size. CUDA's kernels convert an
    operand of another dtype as they read it; ATen on the CPU first copies all of it into the
    result's dtype: a 16-bit gradient's fp32 copy, 4 bytes an element of the largest weight
    (a 480-wide tied embedding's 59 MiB beside its sum on an offloading CPU rank, the
    host's every micro-batch on a GPU machine). There it goes a chunk at a time."""
    contiguous = total.is_contiguous() and g.is_contiguous()
    if total.dtype == g.dtype or total.device.type != "cpu" or not contiguous:
        total.add_(g)
        return
    for part, more in zip(total.view(-1).split(CAST_CHUNK), g.view(-1).split(CAST_CHUNK)):
        part.add_(more)


def _stand_in(weight: torch.Tensor) -> torch.Tensor:
    """A sharded stage's master of a 16-bit weight: the weight's shape in fp32, where its
    gradients sum (autograd's hook, `add_grad`), with no values of its own (one element,
    broadcast): the values are the replicas' shards'."""
    one = torch.zeros((), dtype=torch.float32, device=weight.device)
    return one.expand(weight.shape).detach().requires_grad_(True)


def _injected() -> tuple[int, int] | None:
    text = os.environ.get("FTPIPE_INJECT_INF", "")
    if not text:
        return None
    stage, step = text.split(":")
    return int(stage), int(step)
