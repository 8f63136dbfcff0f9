"""On a CPU the fused LM-head loss writes every chunk's log-softmax (forward) and softmax
(backward) into one kept buffer (`fused_loss._Buffers`), micro-batch after micro-batch: taken
from glibc's heap, which a run keeps whole between optimizer steps, the freed temporaries
were not reused among smaller blocks and the heap grew within a step (a 2-rank PipeDream-2BW
run's loss stage peaked 12-27 MB over its tensors, `tests/runtime/job/test_memory_plan.py`)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from ftpipe_runtime.stage import fused_loss
from ftpipe_runtime.stage.fused_loss import linear_cross_entropy
from torch.utils._python_dispatch import TorchDispatchMode

TOKENS, WIDTH, VOCAB, ROWS = (2, 9), 16, 50, 4  # ROWS tokens a chunk: 5 chunks, the last 2


class Softmaxes(TorchDispatchMode):
    """Where every (log-)softmax run inside writes: its `out` tensor's storage, or None (a
    tensor of its own)."""

    def __init__(self):
        super().__init__()
        self.outs = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket in (torch.ops.aten.log_softmax, torch.ops.aten.softmax):
            out = (kwargs or {}).get("out")
            self.outs.append(None if out is None else out.untyped_storage().data_ptr())
        return func(*args, **(kwargs or {}))


def test_each_chunks_softmax_goes_to_one_kept_buffer(monkeypatch):
    monkeypatch.setitem(fused_loss.CHUNK_BYTES, "cpu", ROWS * VOCAB * 4)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(*TOKENS, WIDTH, generator=g).requires_grad_()
    w = torch.randn(VOCAB, WIDTH, generator=g).requires_grad_()
    t = torch.randint(0, VOCAB, TOKENS, generator=g)
    t[1, :2] = -100
    with Softmaxes() as seen:
        for _ in range(2):  # two micro-batches, their gradients summed
            linear_cross_entropy(x, w, None, t, -100, torch.float32).backward()
    chunks = -(-x.numel() // WIDTH // ROWS)
    assert len(seen.outs) == 2 * 2 * chunks  # each micro-batch: forward and backward
    assert len(set(seen.outs)) == 1 and None not in seen.outs
    held = fused_loss._buffers.held[(ROWS * VOCAB, torch.float32)]
    assert seen.outs[0] in [b.untyped_storage().data_ptr() for b in held]
    loss = F.cross_entropy(F.linear(x, w).view(-1, VOCAB), t.view(-1))
    want = torch.autograd.grad(loss, (x, w))
    for got, r in zip((x.grad, w.grad), want):
        torch.testing.assert_close(got, 2 * r, rtol=1e-5, atol=1e-6)
