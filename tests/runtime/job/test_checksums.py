"""The run's final checksums: float64 sums of every parameter, made a chunk at a time, so the
memory they take at the end of a run (the optimizer state still alive) stays a chunk's,
whatever the size of the parameter (a 128k-vocabulary embedding's float64 copy is GBs)."""

from __future__ import annotations

import weakref

import torch
from ftpipe_runtime.job.report import CHECKSUM_CHUNK, checksums
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class _Allocations(TorchDispatchMode):
    """The most bytes of tensors made by the ops run under it alive at once (a tensor that
    shares its storage with one of the op's inputs, a view or an in-place result, is no
    new allocation)."""

    def __init__(self):
        super().__init__()
        self.live = self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        given = {
            t.untyped_storage().data_ptr()
            for t in tree_leaves((args, kwargs))
            if isinstance(t, torch.Tensor)
        }
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in given:
                n = t.untyped_storage().nbytes()
                self.live += n
                self.peak = max(self.peak, self.live)
                weakref.finalize(t, self._freed, n)
        return out

    def _freed(self, n: int) -> None:
        self.live -= n


def test_checksums_take_a_chunk_of_memory_whatever_the_parameter():
    torch.manual_seed(0)
    net = nn.Module()
    net.big = nn.Parameter(torch.randn(4 * CHECKSUM_CHUNK + 5))  # 16 MB: 4 chunks and a bit
    net.small = nn.Parameter(torch.randn(3, 7, dtype=torch.bfloat16))
    with _Allocations() as seen:
        got = checksums({0: net})
    # A float64 copy of `big` alone would be 32 MB (and its square as much again).
    assert seen.peak <= CHECKSUM_CHUNK * 8 + 1024, seen.peak
    for name, p in net.named_parameters():
        x = p.detach().double()
        want = [float(x.sum()), float((x * x).sum())]
        assert all(abs(a - b) <= 1e-12 * max(abs(b), 1.0) for a, b in zip(got[name], want)), name
