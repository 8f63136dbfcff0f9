"""Where an offloaded optimizer's time goes (`train.offload.Clock`, `PHASES`): each phase the
simulator's host model predicts is timed on the rank's thread, so a GPU run can be held up
against `costs.host.optimizer_times` phase by phase. On CPU ranks the copies are plain copies:
the device-only waits stay at zero."""

from __future__ import annotations

import contextlib

import pytest
import torch
from ftpipe_runtime.train.offload import PHASES, Clock, HostOffload
from ftpipe_runtime.train.optim import make_optimizer
from ftpipe_runtime.train.precision import MixedPrecision, get_precision


def _stepped(on_device: bool) -> dict[str, float]:
    """Two steps of a small bf16 module with its optimizer offloaded: the clock's seconds."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Tanh(), torch.nn.Linear(64, 8))
    net = net.to(torch.bfloat16)
    host = HostOffload("cpu", on_device={0} if on_device else ())
    mixed = MixedPrecision(get_precision("bf16"), {0: net}, offload=host)
    opt = make_optimizer("adamw", [t for _, t in mixed.trainable(0)], 0.01)
    x = torch.randn(16, 64).to(torch.bfloat16)
    for _ in range(2):
        for k in range(3):  # three micro-batches a step
            net(x * (k + 1)).float().square().mean().backward()
        mixed.settle(0)
        with mixed.stepping(0):
            opt.step()
        mixed.after_step(0)
        for _, master in mixed.trainable(0):
            master.grad = None
    return host.clock.seconds


def test_streamed_gradients_time_their_copies_sums_step_and_upload():
    seconds = _stepped(on_device=False)
    assert set(seconds) == set(PHASES)
    for phase in ("to_host", "host_sums", "cpu_step", "to_device"):
        assert seconds[phase] > 0, phase
    for phase in ("copy_wait", "backward_wait", "sum_copies", "upload_wait"):
        assert seconds[phase] == 0, phase  # CUDA's: nothing waits on a CPU rank


def test_device_sums_time_their_one_copy_a_step_and_nothing_streamed():
    seconds = _stepped(on_device=True)
    assert seconds["sum_copies"] > 0 and seconds["cpu_step"] > 0
    assert seconds["to_host"] == seconds["host_sums"] == 0


def test_a_phase_adds_up_and_an_unknown_one_is_refused():
    clock = Clock()
    for _ in range(2):
        with clock.phase("cpu_step"):
            pass
    assert clock.seconds["cpu_step"] > 0
    with pytest.raises(KeyError), clock.phase("lunch"):
        pass


def test_a_stage_kept_beside_its_weights_is_not_timed():
    mixed = MixedPrecision(get_precision("fp32"), {0: torch.nn.Linear(4, 4)})
    assert isinstance(mixed.stepping(0), contextlib.nullcontext)
