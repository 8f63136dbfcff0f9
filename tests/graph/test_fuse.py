"""The LM head and its loss fused after tracing: where the pattern holds and where it does not."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ftpipe_compiler.graph.fuse import fuse_linear_cross_entropy, register

register()  # (importing defines no op)
FUSED = torch.ops.ftpipe.linear_cross_entropy.default
VOCAB = 40


class Head(nn.Module):
    def __init__(self, bias=True, **loss_options):
        super().__init__()
        self.lm_head = nn.Linear(8, VOCAB, bias=bias)
        self.loss_options = loss_options

    def forward(self, h, labels):
        logits = self.lm_head(h).float()
        return F.cross_entropy(logits.view(-1, VOCAB), labels.view(-1), **self.loss_options)


def _exported(module, seed=0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(2, 5, 8, generator=g)
    labels = torch.randint(0, VOCAB, (2, 5), generator=g)
    return torch.export.export(module, (h, labels), strict=False), (h, labels)


def _targets(gm):
    return [n.target for n in gm.graph.nodes if n.op == "call_function"]


def test_the_head_and_its_loss_become_one_op_with_the_same_loss():
    torch.manual_seed(0)
    module = Head()
    program, args = _exported(module)
    gm = program.graph_module
    assert fuse_linear_cross_entropy(gm) == 1
    targets = _targets(gm)
    assert FUSED in targets
    assert torch.ops.aten.cross_entropy_loss.default not in targets
    assert torch.ops.aten.linear.default not in targets
    params = dict(module.named_parameters())
    got = gm(params["lm_head.weight"], params["lm_head.bias"], *args)[0]
    torch.testing.assert_close(got, module(*args), rtol=1e-6, atol=0)


def test_traced_gpt2_and_t5_call_the_fused_op(tiny_gpt2, tiny_t5):
    for traced in (tiny_gpt2[3], tiny_t5[3]):
        targets = _targets(traced.program.graph_module)
        assert FUSED in targets and torch.ops.aten.cross_entropy_loss.default not in targets
        scopes = {
            n.scope for n in traced.graph.nodes if n.op == "ftpipe.linear_cross_entropy.default"
        }
        assert scopes == {"lm_head"}, scopes  # the head's layer at --granularity layer


def test_other_losses_keep_the_unfused_ops():
    for options in ({"label_smoothing": 0.1}, {"reduction": "sum"}):
        gm = _exported(Head(**options))[0].graph_module
        assert fuse_linear_cross_entropy(gm) == 0
        assert torch.ops.aten.cross_entropy_loss.default in _targets(gm)


def test_logits_used_elsewhere_are_not_fused():
    class TwoUses(Head):
        def forward(self, h, labels):
            logits = self.lm_head(h)
            loss = F.cross_entropy(logits.view(-1, VOCAB), labels.view(-1))
            return loss + 0.01 * logits.mean()

    gm = _exported(TwoUses())[0].graph_module
    assert fuse_linear_cross_entropy(gm) == 0


def test_analytic_costs_count_the_heads_product_and_kept_logits(tiny_gpt2):
    from ftpipe_compiler.costs.analytic import analytic_costs
    from ftpipe_compiler.costs.hardware import get_hardware

    spec, task, model, traced = tiny_gpt2
    graph = analytic_costs(traced, get_hardware("rtx2080ti"))
    (head,) = [n for n in graph.nodes if n.op == "ftpipe.linear_cross_entropy.default"]
    vocab, width = spec.config["vocab_size"], spec.config["n_embd"]
    tokens = task.micro_batch * task.seq_len
    assert head.flops == 2 * tokens * width * vocab  # as the unfused linear counted
    # Kept (costs/saved.py, from the fused op's own backward): the fp32 logits, its input
    # (the final norm's output, which no earlier op keeps) and the labels; no log-sum-exp.
    assert head.act_bytes == 4 * tokens * vocab + 4 * tokens * width + 8 * tokens
    assert head.bwd_s > head.fwd_s > 0


def test_logits_are_counted_in_the_products_dtype(tiny_gpt2):
    """A bf16 hidden state makes bf16 logits (2 bytes each); the log-sum-exps stay in the
    loss's dtype."""
    from dataclasses import replace

    from ftpipe_compiler.graph.fuse import logits_bytes

    spec, task, model, traced = tiny_gpt2
    graph = traced.graph
    (head,) = [n for n in graph.nodes if n.op == "ftpipe.linear_cross_entropy.default"]
    hidden = [p for p in graph.preds[head.id] if len(graph.node[p].shape) >= 2]
    tokens, vocab = task.micro_batch * task.seq_len, spec.config["vocab_size"]
    assert logits_bytes(graph, head) == (4 * tokens * vocab, 4 * tokens)
    half = graph.with_nodes(
        [replace(n, dtype="bfloat16") if n.id in hidden else n for n in graph.nodes]
    )
    assert logits_bytes(half, head) == (2 * tokens * vocab, 4 * tokens)
