"""Blocks of a traced program, run and timed one at a time with values passed on the host.

    blocks = plan_blocks(traced, [(node.id, node.members) for node in graph.nodes], device)
    run = run_blocks(traced, blocks, weights, clock, repeats=3, seed=0)
    run["timings"][node.id]   # Timing(fwd_s, recompute_s, bwd_s, act_bytes, peak_bytes)
    run["loss"]               # the model's loss, computed block by block

A block holds only its own parameters on the device while it runs (`Weights` makes them);
the values it hands on wait on the host until their last consumer has run.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field

import torch
from ftpipe_runtime.job.cpu_allocator import release_free_heap
from torch import fx

from ..graph.exported import VIEW_OPS, describe_value, map_tensors, op_name, retarget, tensors_in
from ..graph.trace import Traced


@dataclass(frozen=True)
class Timing:
    fwd_s: float
    recompute_s: float
    bwd_s: float
    act_bytes: int
    peak_bytes: int  # device peak while the block ran (process peak RSS on CPU)
    wgrad_s: float = 0.0  # bwd_s minus the input-gradient pass timed alone (a split's W)


@dataclass
class Block:
    id: str
    calls: list  # (fx name, target, args, kwargs), devices already retargeted
    params: dict  # placeholder -> canonical parameter name
    inputs: list  # values made by earlier blocks, or model-input placeholders
    outputs: list  # members read after this block (and the loss)
    grad_inputs: set  # inputs that carry gradient
    mutates: bool  # an in-place op: every run gets fresh copies of the inputs
    nbytes: int  # parameters + gradients + inputs + every member's output
    free_after: list = field(default_factory=list)  # inputs no later block reads


def plan_blocks(traced: Traced, groups, device) -> list[Block]:
    """One Block per (id, fx member names) group, in execution order."""
    fx_nodes = {n.name: n for n in traced.program.graph.nodes}
    op_graph = traced.graph
    last_use = {op_graph.output: len(groups)}  # the loss outlives every block
    for i, (_, members) in enumerate(groups):
        for m in members:
            for a in _args(fx_nodes[m]):
                last_use[a.name] = max(last_use.get(a.name, -1), i)
    blocks = []
    for i, (gid, members) in enumerate(groups):
        mine, params, inputs, calls, nbytes = set(members), {}, {}, [], 0
        for m in members:
            n = fx_nodes[m]
            for a in _args(n):
                if a.name in mine:
                    continue
                kind, name = traced.placeholders.get(a.name, ("value", a.name))
                (params if kind == "param" else inputs)[a.name] = name
            args, kwargs = retarget(n.args, n.kwargs, device)
            calls.append((m, n.target, args, kwargs))
            if op_name(n.target) not in VIEW_OPS:
                nbytes += describe_value(n.meta.get("val"))[2]
        for name in dict.fromkeys(params.values()):
            p = op_graph.param[name]
            nbytes += p.bytes * (2 if p.trainable else 1)
        nbytes += sum(describe_value(fx_nodes[a].meta.get("val"))[2] for a in inputs)
        outputs = [m for m in members if last_use.get(m, -1) > i]
        grad_in = {a for a in inputs if a in op_graph.node and op_graph.node[a].requires_grad}
        mutates = any(_mutates(fx_nodes[m].target) for m in members)
        blocks.append(Block(gid, calls, params, list(inputs), outputs, grad_in, mutates, nbytes))
    for i, b in enumerate(blocks):
        b.free_after = [a for a in b.inputs if last_use[a] == i]
    return blocks


def run_blocks(
    traced: Traced, blocks: list[Block], weights, clock, repeats, seed, progress=None
) -> dict:
    """Time the blocks in order, host values passed along; {"timings": {id: Timing}, "loss"}."""
    torch.manual_seed(seed)  # dropout masks
    host: dict = {}
    model_inputs = weights.model_inputs()
    for name, (kind, key) in traced.placeholders.items():
        if kind == "input":
            host[name] = model_inputs[key]
    timings = {}
    for b in blocks:
        clock.reset_peak()  # the block's peak: its weights, inputs, activations, gradients
        params = weights.materialise(b.params)
        timings[b.id], outs = time_block(b, params, host, clock, repeats, seed)
        host.update(zip(b.outputs, (map_tensors(o, lambda t: t.detach().to("cpu")) for o in outs)))
        for a in b.free_after:
            host.pop(a, None)
        del params, outs
        release_free_heap()
        if progress:
            progress()
    loss = host.get(traced.graph.output)
    return {"timings": timings, "loss": None if loss is None else float(loss)}


def time_block(b: Block, params: dict, host: dict, clock, repeats: int, seed: int):
    """(Timing, the block's output values) from one warm-up and `repeats` timed runs (the
    peak counts from the caller's `clock.reset_peak()`, before it materialised `params`)."""
    leaves = {a: map_tensors(host[a], _leaf(clock.device, a in b.grad_inputs)) for a in b.inputs}
    grad_wrt = [t for t in params.values() if t.requires_grad]
    wrt_inputs = [t for a in b.grad_inputs for t in tensors_in(leaves[a]) if t.requires_grad]
    split = bool(grad_wrt and wrt_inputs)  # both kinds of gradient: time B alone as well
    grad_wrt += wrt_inputs
    param_ptrs = {t.untyped_storage().data_ptr() for t in params.values()}

    def env():
        values = (
            {a: map_tensors(v, torch.clone) for a, v in leaves.items()} if b.mutates else leaves
        )
        return {**params, **values}

    fwd, rec, bwd, inp, saved, upstream, first = [], [], [], [], {}, None, None
    for r in range(repeats + 1):
        with torch.no_grad():
            t_f, outs = clock.time(_forward, b, env())
        first = outs if first is None else first
        # Run 0 also adds up what autograd saves for backward (not timed: it is a warm-up).
        pack = _saver(saved, param_ptrs) if r == 0 else _same
        with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, _same):
            t_r, outs = clock.time(_forward, b, env())
        targets = [t for t in tensors_in(outs) if t.requires_grad]
        if upstream is None:
            g = torch.Generator(device=clock.device).manual_seed(seed)
            upstream = [_upstream(t, g) for t in targets]
        t_b = t_i = 0.0
        if targets and grad_wrt:
            t_b, _ = clock.time(_backward, targets, grad_wrt, upstream, split)
            if split:  # the graph was kept: B alone, the input gradients
                t_i, _ = clock.time(_backward, targets, wrt_inputs, upstream)
        del outs, targets
        if r:  # run 0 is the warm-up
            fwd.append(t_f)
            rec.append(t_r)
            bwd.append(t_b)
            inp.append(t_i if split else (t_b if wrt_inputs else 0.0))
    act = sum(saved.values())
    wgrad = max(_median(bwd) - _median(inp), 0.0) if grad_wrt else 0.0
    timing = Timing(_median(fwd), _median(rec), _median(bwd), act, clock.peak_bytes(), wgrad)
    return timing, first


def _backward(targets, wrt, upstream, keep: bool = False) -> None:
    # The gradients are dropped at once: two sets alive together would double their memory.
    torch.autograd.grad(targets, wrt, upstream, allow_unused=True, retain_graph=keep)


def _leaf(device, requires_grad: bool):
    # An op's integer outputs (indices of max, say) never carry gradient.
    return lambda t: t.to(device).detach().requires_grad_(requires_grad and t.is_floating_point())


def _same(t):
    return t


def _forward(b: Block, env: dict) -> list:
    values = dict(env)
    for name, target, args, kwargs in b.calls:
        a, k = fx.node.map_arg((args, kwargs), lambda n: values[n.name])
        values[name] = target(*a, **k)
    return [values[o] for o in b.outputs]


def _saver(saved: dict, skip: set):
    """A pack hook adding up the storages autograd keeps, parameters excluded."""

    def pack(t):
        s = t.untyped_storage()
        if s.data_ptr() not in skip:
            saved[s.data_ptr()] = s.nbytes()
        return t

    return pack


def _upstream(t: torch.Tensor, g) -> torch.Tensor:
    if t.dim() == 0:  # the loss
        return torch.ones_like(t)
    return torch.randn(t.shape, dtype=t.dtype, device=t.device, generator=g)


def _mutates(target) -> bool:
    schema = getattr(target, "_schema", None)
    return bool(schema) and any(a.alias_info and a.alias_info.is_write for a in schema.arguments)


def _args(n: fx.Node) -> list:
    found = []
    fx.node.map_arg((n.args, n.kwargs), found.append)
    return found


def _median(xs) -> float:
    return float(statistics.median(xs)) if xs else 0.0
