"""Models for `package.module:function` specs in tests (tests/ is on sys.path under pytest)."""

import torch
from torch import nn


class LinearLoss(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(64, 48, bias=False)

    def forward(self, x):
        return self.proj(x).square().mean()


def linear_model():
    return LinearLoss(), (torch.randn(8, 64),)


def not_a_pair():
    return LinearLoss()


class DataDependent(nn.Module):
    def forward(self, x):
        if x.sum() > 0:  # data-dependent control flow: export cannot trace it
            return x.mean()
        return x.sum()


def untraceable_model():
    return DataDependent(), (torch.randn(4, 4),)


def raising_model():
    raise ValueError("no weights in /nowhere")


class PerSample(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, x):
        return self.proj(x).square().mean(dim=1)  # one loss per sample: not a scalar


def vector_model():
    return PerSample(), (torch.randn(4, 8),)


class Refusing(nn.Module):
    def forward(self, x):
        raise RuntimeError("this model only runs on Tuesdays")


def forward_raises_model():
    return Refusing(), (torch.randn(2, 2),)


class OneOp(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.ones(4))

    def forward(self, x):
        return torch.dot(x, self.w)  # the whole model is one operator


def one_node_model():
    return OneOp(), (torch.randn(4),)


class NoGradTable(nn.Module):
    """A rotary-style table computed under torch.no_grad(), as Llama's rotary embedding was up to
    transformers 5.23: export wraps such code in a sub-graph call, which the trace splices in."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 8)
        self.table = nn.Linear(8, 8)  # used only under no_grad: its output takes no gradient

    def forward(self, x):
        with torch.no_grad():
            angle = self.table(x)
            cos, sin = angle.cos(), angle.sin()
        return (self.proj(x) * cos + sin).square().mean()


def no_grad_model():
    return NoGradTable(), (torch.randn(4, 8),)


class Wide(nn.Module):
    """Eight 16k x 16k layers: 2.15 B parameters, 32 GiB to train in fp32 with AdamW."""

    def __init__(self):
        super().__init__()
        self.layers = nn.Sequential(*(nn.Linear(16384, 16384, bias=False) for _ in range(8)))

    def forward(self, x):
        return self.layers(x).square().mean()


def wide_model():
    with torch.device("meta"):  # traced, never run: no 8 GiB of weights in a test
        return Wide(), (torch.randn(2, 16384),)


class DeepThenBranches(nn.Module):
    """Forty layers, then a branch on the data: the exporter prints the graph it had."""

    def __init__(self):
        super().__init__()
        self.layers = nn.Sequential(*(nn.Linear(4, 4) for _ in range(40)))

    def forward(self, x):
        y = self.layers(x)
        return y.mean() if y.sum() > 0 else y.sum()


def deep_untraceable_model():
    return DeepThenBranches(), (torch.randn(4, 4),)
