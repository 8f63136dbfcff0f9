"""When no plan fits: one sentence of what training needs, what the GPUs have, and which
options would fit, instead of every partitioner's and schedule's own reason.

    check_floor(problem, "llama-3.1-8b", schedules)   # before the search: the weights alone
    explain(problem, "llama-3.1-8b", schedules, matrix)  # after it: with the activations

The floor is what every plan holds whatever its cut: each parameter's weight, gradient and
optimizer state (`Problem.static_bytes`, one weight version). When it exceeds the GPUs'
memory together, no partitioner is run. More GPUs are counted by planning for them (the
chain partitioner under the schedules asked for, the fewest GPUs where its plan fits);
--dtype bf16-pure and --lora by their floor alone (they change what is traced), so they are
offered as what would hold the weights, before activations. Host offload (`--offload`) is
offered when a plan with it fits these GPUs and the hosts' memory (planned, as --gpus); a
problem that already offloads (`Problem.offload`) counts its GPU floor without what the host
may hold, and the host's memory beside it.
"""

from __future__ import annotations

import math
from dataclasses import replace

from ..costs.formulas import PRECISIONS, optimizer_state_elements, param_bytes
from ..costs.host import host_param_bytes
from ..errors import FtpipeError, InfeasibleError
from ..partition import Problem
from ..units import size
from .matrix import evaluate

__all__ = ["check_floor", "explain", "floor_fits", "gpus_that_fit"]

MAX_GPUS = 256  # the search for a GPU count gives up beyond this many
LINEAR = {"Linear", "Conv1D"}  # module types LoRA adapts (Conv1D: GPT-2's linear layers)
HEADS = {"lm_head", "score", "classifier", "qa_outputs"}  # trained whole, not adapted


def check_floor(problem: Problem, model: str, schedules: list[str], steps: int = 20) -> None:
    """Raise InfeasibleError with what would fit when the weights, gradients and optimizer
    state alone exceed the GPUs' memory together (or, offloading, the hosts')."""
    if not floor_fits(problem):
        raise InfeasibleError(_message(problem, model, schedules, steps, activations=False))


def floor_fits(problem: Problem) -> bool:
    """Do the GPUs together hold what every plan keeps on them whatever its cut, and the
    hosts what offloading every stage's optimizer would put there?"""
    if _gpu_floor(problem) > problem.gpus * problem.memory:
        return False
    return _host_floor(problem) <= _host_capacity(problem)


def _gpu_floor(problem: Problem) -> int:
    """What every plan keeps on the GPUs: `_floor` less what the host may hold."""
    return sum(sum(split) for split in problem.gpu_param_split.values())


def _host_floor(problem: Problem) -> int:
    """Host bytes when every trainable parameter's optimizer is offloaded (0: no offload)."""
    if problem.offload not in ("auto", "optimizer"):
        return 0
    return sum(
        host_param_bytes(p.shape, p.dtype, problem.optimizer, problem.precision)
        for p in problem.graph.params
        if p.trainable
    )


def _host_capacity(problem: Problem) -> int:
    host = problem.hardware.host
    return host.memory_bytes * math.ceil(problem.gpus / host.gpus_per_node)


def explain(
    problem: Problem, model: str, schedules: list[str], matrix, steps: int = 20
) -> InfeasibleError:
    """The error for a search in which no plan fits although the floor does; when no
    schedule asked for could even be planned (e.g. --dtype fp16 under an asynchronous one),
    their own reasons, not memory."""
    if matrix and all(c.status == "n/a" for c in matrix):
        return InfeasibleError("; ".join(dict.fromkeys(c.note for c in matrix if c.note)))
    tightest = min((c.sim.max_memory_bytes for c in matrix if c.sim is not None), default=None)
    return InfeasibleError(_message(problem, model, schedules, steps, activations=True,
                                    tightest=tightest))  # fmt: skip


def gpus_that_fit(
    problem: Problem, schedules: list[str], start: int, steps: int = 20
) -> tuple[int, str] | None:
    """(the fewest GPUs from `start` on which a plan fits, under which schedule) by the chain
    partitioner (its split is the best contiguous one, memory included); None past MAX_GPUS."""
    for n in range(start, MAX_GPUS + 1):
        for s in schedules:
            try:
                sub = replace(problem, gpus=n, schedule=s)
            except FtpipeError:  # e.g. too few micro-batches for the schedule's pattern
                continue
            if not floor_fits(sub):  # no partition can fit: not worth one (~0.1-1 s each)
                continue
            if evaluate(sub, "pipedream", math.nan, steps).status == "ok":
                return n, s
    return None


def _floor(problem: Problem, precision=None, lora: bool = False) -> int:
    """Bytes every plan holds: weights, gradients and optimizer state, one weight version;
    under another precision (the parameters in its dtype) or with every weight frozen."""
    if precision is None and not lora:
        return sum(problem.static_bytes.values())
    precision = precision or problem.precision
    total = 0
    for p in problem.graph.params:
        dtype = precision.compute if p.dtype.startswith(("float", "bfloat")) else p.dtype
        weight, rest = param_bytes(p.shape, dtype, p.trainable and not lora,
                                   problem.optimizer, precision)  # fmt: skip
        total += weight + rest
    return total


def _per_parameter(problem: Problem) -> str:
    """'16 B per trainable parameter (2 B weight + 4 B fp32 master + ...)'."""
    p, trainable = problem.precision, [q for q in problem.graph.params if q.trainable]
    numel = sum(math.prod(q.shape) for q in trainable) or 1
    state = sum(optimizer_state_elements(q.shape, problem.optimizer) for q in trainable) / numel
    parts = [f"{p.weight} B weight"]
    parts += [f"{p.master} B fp32 master"] * bool(p.master)
    parts += [f"{p.grad} B gradient"]
    if state:
        parts.append(f"{state:.3g} x {p.state} B {problem.optimizer} state")
    per = p.weight + p.master + p.grad + state * p.state
    return f"{_count(numel)} trainable parameters x {per:.3g} B: {' + '.join(parts)} in {p.name}"


def _count(n: int) -> str:
    """8.03 billion, 124 million, 139 thousand (B would read as bytes here)."""
    for scale, word in ((1e9, "billion"), (1e6, "million"), (1e3, "thousand")):
        if n >= scale:
            return f"{n / scale:.3g} {word}"
    return str(n)


def _message(problem: Problem, model: str, schedules, steps: int, *, activations: bool,
             tightest=None) -> str:  # fmt: skip
    hw, gpus, mem = problem.hardware.name, problem.gpus, problem.memory
    floor = _floor(problem)
    need = (
        f"{model} needs {size(floor)} for its weights, gradients and optimizer state "
        f"({_per_parameter(problem)}), {size(floor / gpus)} per GPU on {gpus}"
    )
    if problem.offload != "none":
        host = _host_floor(problem)
        need += (
            f"; offloading to the host (--offload {problem.offload}) leaves "
            f"{size(_gpu_floor(problem) / gpus)} per GPU"
            + (f" and {size(host)} of host memory (the hosts have "
               f"{size(_host_capacity(problem))})" if host else "")
        )  # fmt: skip
        floor = _gpu_floor(problem)
    if activations:
        closest = (
            f": the closest plan needs {size(tightest)} on its fullest GPU" if tightest else ""
        )
        need += (
            f", within one {hw}'s {problem.memory_said()}, but no split of it fits with the activations "
            f"on every GPU{closest}"
        )
        start = gpus + 1
    elif _host_floor(problem) > _host_capacity(problem):
        need += ": more than the hosts hold"
        start = gpus + 1
    else:
        need += f" before any activation, more than one {hw}'s {problem.memory_said()}"
        start = max(gpus + 1, math.ceil(floor / mem)) if mem > 0 else gpus + 1
    options = []
    if problem.offload == "none" and not problem.hardware.host.device_is_host:
        offload = _offload_option(problem, schedules, steps)
        options += [offload] if offload else []
    found = gpus_that_fit(problem, schedules, start, steps)
    if found is not None:
        n, s = found
        options.append(f"--gpus {n} (checked: a plan under {s} fits)")
    else:
        options.append(f"no GPU count up to {MAX_GPUS} with these options")
    if activations:
        options.append("a smaller --micro-batch or --seq-len (activations scale with them)")
    pure = PRECISIONS["bf16-pure"]
    if problem.precision.name != pure.name:
        options.append(_alternative("--dtype bf16-pure", _floor(problem, pure), problem))
    targets = _linear_names(problem.graph)
    if targets and any(p.trainable for p in problem.graph.params):
        lora = _floor(problem, lora=True)
        option = f"--lora r=16,alpha=32,targets={','.join(targets)}"
        options.append(_alternative(option, lora, problem, "plus the adapters"))
    return f"{need}; would fit: " + "; ".join(options)


def _offload_option(problem: Problem, schedules, steps: int) -> str | None:
    """'--offload auto (checked: ...)' when a plan offloading to the host fits these GPUs
    and the hosts' memory; None when none does."""
    offloading = replace(problem, offload="auto")
    if not floor_fits(offloading):
        return None
    for s in schedules:
        try:
            sub = replace(offloading, schedule=s)
        except FtpipeError:
            continue
        cell = evaluate(sub, "pipedream", math.nan, steps)
        if cell.status == "ok":
            what = sorted({x.offload.words() for x in cell.plan.stages if x.offload.any})
            where = sum(x.offload.any for x in cell.plan.stages)
            return (
                f"--offload auto (checked: a plan under {s} fits with the {' / '.join(what)} "
                f"of {where} stage{'s' * (where > 1)} on the host)"
            )
    return None


def _alternative(option: str, floor: int, problem: Problem, extra: str = "") -> str:
    """An option that changes the floor: what it would be, and whether these GPUs hold it."""
    gpus = max(1, math.ceil(floor / problem.memory)) if problem.memory > 0 else math.inf
    where = (
        f"within these {problem.gpus} GPUs before activations"
        if gpus <= problem.gpus
        else f"at least {gpus} GPUs"
    )
    return f"{option} ({size(floor)}{' ' + extra if extra else ''}: {where})"


def _linear_names(graph) -> list[str]:
    """The names LoRA targets: the linear layers' last scope part, in the graph's order
    (q_proj, k_proj, ... for Llama; q, k, v, o, wi, wo for T5), the heads left out."""
    names = (n.scope.rpartition(".")[2] for n in graph.nodes if n.module_type in LINEAR)
    return [n for n in dict.fromkeys(names) if n and n not in HEADS]
