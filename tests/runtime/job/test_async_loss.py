"""The loss stage's losses reach rank 0's report without the rank waiting for the GPU: the
executor leaves them on the device, `Progress` reads them once they are there, in order."""

from __future__ import annotations

import types

import pytest
import torch
from ftpipe_runtime.engine.executor import Executor
from ftpipe_runtime.job.report import Progress

needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")


def _recorder(progress, device, m=2):
    """The executor's loss bookkeeping alone, on rank 0 holding the loss stage."""
    return types.SimpleNamespace(
        m=m, losses={}, comm=types.SimpleNamespace(global_rank=0), on_loss=progress.loss,
        start=0.0, device=torch.device(device),
    )  # fmt: skip


def test_on_a_cpu_every_step_is_reported_at_once():
    progress = Progress(False, steps=3, first=0, samples_per_step=4)
    ex = _recorder(progress, "cpu")
    for mb, value in enumerate([1.0, 3.0, 2.0, 4.0]):  # shares of their step's loss
        Executor._record_loss(ex, mb, torch.tensor(value))
    assert progress.losses == {0: 4.0, 1: 6.0} and not progress.pending
    assert ex.losses == {}


@pytest.mark.cuda
@needs_gpu
def test_on_a_gpu_recording_a_loss_never_waits_for_it():
    progress = Progress(False, steps=2, first=0, samples_per_step=4)
    ex = _recorder(progress, "cuda")
    # A kernel's first launch in a process loads it (CUDA's lazy loading) and pinned host
    # memory comes from cudaHostAlloc: both wait for the device, once. A run's first step
    # pays that; here a warm-up round does.
    warm = Progress(False, steps=2, first=0, samples_per_step=4)
    warm_ex = _recorder(warm, "cuda")
    for mb in range(4):
        Executor._record_loss(warm_ex, mb, torch.full((), 1.0, device="cuda"))
    warm.close()
    assert warm.losses == {0: 2.0, 1: 2.0}
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # any wait for the GPU raises
    try:
        torch.cuda._sleep(2_000_000_000)  # the GPU busy for a while: the losses come after
        for mb in range(4):
            Executor._record_loss(ex, mb, torch.full((), float(mb), device="cuda"))
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert progress.losses == {}  # not there yet, and nobody waited
    progress.close()  # the end of the run: read them all
    assert progress.losses == {0: 1.0, 1: 5.0}  # the shares' sums
    assert list(progress.times) == [0, 1]
