"""Tiny model functions for tests/costs/test_saved.py: each applies one family of ops to the
output of a linear layer (so that gradient flows) and returns a scalar loss."""

import torch
from torch import nn
from torch.nn import functional as F

TOKENS, WIDTH = 8, 16


class Apply(nn.Module):
    def __init__(self, fn, extra: int = 0):
        super().__init__()
        self.proj = nn.Linear(WIDTH, WIDTH, bias=False)
        self.more = nn.Linear(WIDTH, WIDTH, bias=False)
        self.fn = fn

    def forward(self, x):
        return self.fn(self, self.proj(x)).float().square().mean()


def _model(fn):
    def make():
        return Apply(fn), (torch.randn(TOKENS, WIDTH),)

    return make


# Nothing kept: adds (a residual), a multiplication by a constant, a cast.
free_ops = _model(lambda m, h: (h + h * 2.0).to(torch.float64))
# A linear keeps its input, not its output; its weight counts with the weights.
linear = _model(lambda m, h: m.more(h))
# A softmax keeps its output, which its consumer keeps too: counted once, on the softmax.
softmax = _model(lambda m, h: h.softmax(-1) @ h.t())
# Dropout keeps a mask: a boolean one on a GPU (its fused kernel), a scaled fp32 one on a CPU.
dropout = _model(lambda m, h: F.dropout(h, 0.5, training=True))
# Two consumers keep the same tensor (sin and cos keep their input; one through a view, one
# through a cast to its own dtype, which returns it): counted once, on the first.
shared = _model(lambda m, h: h.view(-1).sin().view(TOKENS, WIDTH) + h.to(torch.float32).cos())


def _attention(m, h):
    q = k = v = h.view(2, 2, TOKENS // 2, WIDTH // 2)  # batch 2, heads 2, 4 rows, 8 wide
    return F.scaled_dot_product_attention(q, k, v, is_causal=True).reshape(TOKENS, WIDTH)


attention = _model(_attention)
