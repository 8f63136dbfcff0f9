"""A backward split into B (input gradients) and W (weight gradients) equals one backward.

Checked on a hand-written network (a weight read twice, a parameter sent as an output, a
stage fed only ids) and on generated stages of tiny T5, GPT-2 and Llama plans chained in
one process, with and without recompute, every W deferred until all B's ran. Also: W does
not run B's work again, and the graph is released after W.
"""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from ftpipe_runtime.engine.split_backward import backward_input, backward_weight
from ftpipe_runtime.job.check import synthetic_inputs
from ftpipe_runtime.train.precision import MixedPrecision, get_precision

pytest.importorskip("transformers")
from ftpipe_compiler.codegen import generate_package, import_package  # noqa: E402
from ftpipe_compiler.costs.hardware import get_hardware  # noqa: E402
from ftpipe_compiler.costs.profilers import costed_graph  # noqa: E402
from ftpipe_compiler.partition import build_plan  # noqa: E402
from ftpipe_compiler.partition.problem import Problem  # noqa: E402


class Counted(torch.autograd.Function):
    """Identity that counts the gradients it passes back (autograd's own formulas, like this
    one, do no work for a node given no gradient): it sits on the path to the inputs."""

    calls = 0

    @staticmethod
    def forward(ctx, x):
        ctx.set_materialize_grads(False)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        Counted.calls += g is not None
        return g


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.layers = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(4))
        self.norm = torch.nn.LayerNorm(8)
        self.emb = torch.nn.Parameter(torch.randn(16, 8))

    def forward(self, x, ids, record=None):
        h = x + self.emb[ids]
        for layer in self.layers:
            if record is not None:  # the layer's input: its weight gradient needs it
                record.append(weakref.ref(h))
            h = torch.tanh(layer(Counted.apply(h))) + h
        h = self.norm(h)
        # emb read again (tied head), and sent as an output like an owner stage's weight.
        return {"y": h, "loss": (h @ self.emb.T).logsumexp(-1).mean(), "emb": self.emb}


def _grads(net, split: bool, x_grad: bool = True):
    for p in net.parameters():
        p.grad = None
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(3, 5, 8, generator=gen).requires_grad_(x_grad)
    ids = torch.randint(0, 16, (3, 5), generator=gen)
    out = net(x, ids)
    roots = [out["loss"], out["y"], out["emb"]]
    grads = [None, torch.randn(3, 5, 8, generator=gen), torch.randn(16, 8, generator=gen)]
    if split:
        later = backward_input(roots, grads, [x], list(net.parameters()))
        assert all(p.grad is None for p in net.parameters())  # B leaves the weights alone
        del out, roots
        backward_weight(later)
    else:
        torch.autograd.backward(roots, grads)
    return x.grad, {n: p.grad for n, p in net.named_parameters()}


@pytest.mark.parametrize("x_grad", [True, False])
def test_b_then_w_is_one_backward_bit_for_bit(x_grad):
    net = Net()
    full_x, full = _grads(net, False, x_grad)
    Counted.calls = 0
    split_x, split = _grads(net, True, x_grad)
    # Fed no gradient-carrying input (a first stage) B has nothing to do: W does it all.
    assert Counted.calls == 4  # once per layer, in B or (no input gradient) in W
    if x_grad:
        assert torch.equal(full_x, split_x)
    assert full.keys() == split.keys()
    for name in full:
        assert torch.equal(full[name], split[name]), name


def test_w_does_not_walk_the_input_path_again():
    net = Net()
    x = torch.randn(3, 5, 8, requires_grad=True)
    out = net(x, torch.zeros(3, 5, dtype=torch.long))
    Counted.calls = 0
    later = backward_input([out["loss"]], [None], [x], list(net.parameters()))
    assert Counted.calls == 4  # each layer's input gradient, once
    backward_weight(later)
    assert Counted.calls == 4  # and not again for the weights


def test_the_graph_is_released_after_w():
    """Layer outputs are what the next layer's weight gradient needs: B keeps them, W frees."""
    net, alive = Net(), []
    x = torch.randn(3, 5, 8, requires_grad=True)
    out = net(x, torch.zeros(3, 5, dtype=torch.long), alive)
    later = backward_input([out["loss"]], [None], [x], list(net.parameters()))
    del out
    gc.collect()
    assert sum(r() is not None for r in alive) == 4  # kept for W
    backward_weight(later)
    assert all(p.grad is not None for p in net.parameters())
    del later
    gc.collect()
    assert sum(r() is not None for r in alive) == 0


def _backwards(net, dtype, count: int):
    """`count` micro-batches' (roots, their gradients, the input) for `net` in `dtype`."""
    gen = torch.Generator().manual_seed(1)
    for _ in range(count):
        x = torch.randn(3, 5, 8, generator=gen).to(dtype).requires_grad_(True)
        out = net(x, torch.randint(0, 16, (3, 5), generator=gen))
        grads = [None, torch.randn(3, 5, 8, generator=gen), torch.randn(16, 8, generator=gen)]
        grads[1:] = [g.to(dtype) for g in grads[1:]]
        yield [out["loss"], out["y"], out["emb"]], grads, x


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_w_in_16_bits_accumulates_into_the_fp32_masters_like_one_backward(dtype):
    """Micro-batch after micro-batch, W hands each gradient to its fp32 master (the run's
    `MixedPrecision.add_grad`) as autograd's hook does for a whole backward: the masters
    hold the fp32 sum of every micro-batch's 16-bit gradient, the same either way, and the
    16-bit weights hold none (summing them in 16 bits until the step would round)."""
    precision, count = get_precision(dtype), 4

    def masters(split: bool) -> dict[str, torch.Tensor]:
        net = Net().to(precision.dtype)
        mixed = MixedPrecision(precision, {0: net})
        for roots, grads, x in _backwards(net, precision.dtype, count):
            if split:
                later = backward_input(roots, grads, [x], list(net.parameters()))
                backward_weight(later, mixed.add_grad)
            else:
                torch.autograd.backward(roots, grads)
            assert all(p.grad is None for p in net.parameters())
        return {n: t.grad for n, t in mixed.trainable(0)}

    net = Net().to(precision.dtype)  # the reference: each micro-batch's gradient, fp32 sum
    want = {n: torch.zeros_like(p, dtype=torch.float32) for n, p in net.named_parameters()}
    for roots, grads, _ in _backwards(net, precision.dtype, count):
        for n, g in zip(want, torch.autograd.grad(roots, list(net.parameters()), grads)):
            want[n] += g.float()
    whole, split = masters(False), masters(True)
    assert whole.keys() == split.keys() == want.keys()
    for name, g in want.items():
        assert whole[name].dtype == split[name].dtype == torch.float32
        torch.testing.assert_close(whole[name], g, rtol=0, atol=0, msg=name)
        torch.testing.assert_close(split[name], g, rtol=0, atol=0, msg=name)


def _chain(stages, plan, inputs, split: bool, recompute: bool):
    """Run the stages like the pipeline (received tensors detached): forwards in order, B's
    in reverse, and, when split, every W only after all B's. Returns the loss and the
    parameter gradients."""
    grad_flows = {t["tensor"]: t["requires_grad"] for t in plan["transfers"]}
    sent, received, outputs = {}, {}, {}
    for k in sorted(stages):
        kwargs = {}
        for name in stages[k].INPUTS:
            value = inputs[name] if name in inputs else sent[name].detach()
            kwargs[name] = value.requires_grad_(grad_flows.get(name, False))
        with torch.set_grad_enabled(not recompute):
            outputs[k] = stages[k](**kwargs)
        received[k] = kwargs
        sent.update(outputs[k])
    loss = outputs[plan["loss_stage"]]["loss"].detach()
    grads, later = {}, []
    for k in sorted(stages, reverse=True):
        out = outputs[k]
        if recompute:  # B re-runs the forward from the saved stage inputs
            with torch.enable_grad():
                out = stages[k](**received[k])
        roots, seeds = ([out["loss"]], [None]) if k == plan["loss_stage"] else ([], [])
        for n, t in out.items():
            if n != "loss" and t.requires_grad and n in grads:
                roots.append(t)
                seeds.append(grads[n])
        ins = [t for n, t in received[k].items() if n not in inputs and t.requires_grad]
        if split:
            later.append(backward_input(roots, seeds, ins, list(stages[k].parameters())))
        elif roots:
            torch.autograd.backward(roots, seeds)
        for name, t in received[k].items():
            if name not in inputs and t.grad is not None:
                grads[name] = grads[name] + t.grad if name in grads else t.grad
    for deferred in later:
        backward_weight(deferred)
    named = {n: p.grad for s in stages.values() for n, p in s.named_parameters()}
    return loss, named


@pytest.fixture(scope="module")
def packages(tmp_path_factory):
    out = {}
    for model in ("t5-tiny", "gpt2-tiny", "llama-tiny"):
        spec, _, traced, graph = costed_graph(model)
        n = len(graph.nodes)
        stage_of = {node.id: i * 3 // n for i, node in enumerate(graph.nodes)}
        problem = Problem(graph, gpus=3, hardware=get_hardware("rtx2080ti"), memory_bytes=2**50)
        plan = build_plan(problem, stage_of, {s: s for s in range(3)}, "test")
        folder = tmp_path_factory.mktemp(model)
        out[model] = import_package(generate_package(traced, graph, plan, spec, folder, "pytest"))
    return out


@pytest.mark.parametrize("recompute", [False, True], ids=["kept", "recomputed"])
@pytest.mark.parametrize("model", ["t5-tiny", "gpt2-tiny", "llama-tiny"])
def test_generated_stages_b_then_w_equals_one_backward(packages, model, recompute):
    mod = packages[model]
    plan = mod.load_plan()
    inputs = synthetic_inputs(plan)
    stages = {k: cls() for k, cls in mod.STAGES.items()}
    for s in stages.values():
        s.eval()  # dropout off: the recompute replays nothing random
    loss, full = _chain(stages, plan, inputs, split=False, recompute=False)
    for s in stages.values():
        s.zero_grad(set_to_none=True)
    loss_split, split = _chain(stages, plan, inputs, split=True, recompute=recompute)
    assert loss_split == loss
    assert full.keys() == split.keys()
    assert sum(g is not None for g in full.values()) > 10
    for name, g in full.items():
        if g is None:
            assert split[name] is None, name
            continue
        torch.testing.assert_close(split[name], g, rtol=0, atol=1e-6, msg=name)
