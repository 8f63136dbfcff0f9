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
