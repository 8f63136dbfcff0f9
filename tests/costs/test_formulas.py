"""The one cost and memory model: eq. 1, parameter bytes by precision, versions, frozen."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from ftpipe_runtime.schedules import StagePolicy

from ftpipe_compiler.costs.formulas import (
    FP32,
    OPTIMIZERS,
    PRECISIONS,
    Precision,
    gpu_memory_bytes,
    optimizer_state_elements,
    param_bytes,
    period_s,
    stage_memory,
    weight_copies,
)


def test_period_is_compute_plus_what_transfers_do_not_hide():
    assert period_s(1.0, 0.5, 0.9) == 1.0
    assert period_s(1.0, 1.5, 0.2) == pytest.approx(1.5)
    assert period_s(1.0, 1.5, 3.0) == pytest.approx(1.0 + 0.5 + 2.0)


def test_parameter_bytes_by_optimizer_trainability_and_dtype():
    shape = (1024, 4096)
    n = 1024 * 4096
    assert param_bytes(shape, "float32", True, "adamw") == (4 * n, 4 * n + 8 * n)
    assert param_bytes(shape, "float32", True, "sgd") == (4 * n, 4 * n)
    assert param_bytes(shape, "float32", True, "adafactor") == (4 * n, 4 * n + 4 * (1024 + 4096))
    assert param_bytes((4096,), "float32", True, "adafactor") == (4 * 4096, 8 * 4096)
    # Frozen: one copy, no gradient, no optimizer state; integer buffers keep their dtype.
    assert param_bytes(shape, "float32", False, "adamw") == (4 * n, 0)
    assert param_bytes((1, 512), "int64", False, "adamw") == (8 * 512, 0)
    # Bytes per element come from the precision, not from hard-coded fours.
    wide = Precision("test", weight=8, grad=8, state=8, master=4)
    assert param_bytes(shape, "float32", True, "adamw", wide) == (8 * n, 12 * n + 16 * n)
    assert PRECISIONS["fp32"] == FP32
    with pytest.raises(ValueError, match="unknown optimizer 'lion'"):
        param_bytes(shape, "float32", True, "lion")


def test_stage_and_gpu_memory_follow_the_policy():
    kw = dict(trainable_bytes=100, frozen_bytes=30, state_bytes=200, input_bytes=7, act_bytes=50)
    # Recomputing, 3 in flight, two versions of the trainable weights (2BW, WPipe's G0): the
    # live weights and the older version set aside; keeping its graphs (no recompute, or a
    # split backward) it also sets aside, at the next step's first forward, the version the
    # live weights hold until that step (`weight_copies`); with one micro-batch in flight
    # (2BW's loss stage) the live weights are the newer version.
    two = StagePolicy(recompute=True, in_flight=3, weight_versions=2, weight_delay=1)
    assert weight_copies(two) == 2 and weight_copies(StagePolicy(True, 3)) == 1
    assert weight_copies(replace(two, recompute=False)) == 3
    assert weight_copies(replace(two, split=True)) == 3
    assert weight_copies(replace(two, recompute=False, in_flight=1)) == 2
    assert stage_memory(**kw, policy=two) == (2 * 100 + 30 + 200 + 3 * 7, 50)
    keeps = StagePolicy(recompute=False, in_flight=2)
    assert stage_memory(**kw, policy=keeps) == (100 + 30 + 200 + 2 * 50, 0)
    # A GPU: everything held, plus the largest recompute buffer (one backward at a time).
    assert gpu_memory_bytes([(10, 5), (20, 8), (1, 0)]) == 31 + 8
    # Arrays pass through (the partitioners' batched calls).
    arrays = {k: np.array([v, 2 * v]) for k, v in kw.items()}
    held, transient = stage_memory(**arrays, policy=two)
    assert held.tolist() == [451, 902] and transient.tolist() == [50, 100]


def test_an_optimizer_step_streams_what_each_parameter_holds_twice():
    """Read and written once: 2 x held bytes at the step bandwidth, the cache's for a
    parameter whose step fits in the last-level cache, memory's for a larger one; without
    measured figures, the roofline's memory bandwidth."""
    from ftpipe_compiler.costs.formulas import optimizer_step_s
    from ftpipe_compiler.costs.hardware import get_hardware

    hw = replace(
        get_hardware("cpu"),
        optimizer_bandwidth=1e9,
        optimizer_cache_bandwidth=4e9,
        cache_bytes=32 * 2**20,
    )
    small, large = 16 * 2**20, 64 * 2**20
    assert optimizer_step_s([small], hw) == pytest.approx(2 * small / 4e9)
    assert optimizer_step_s([large], hw) == pytest.approx(2 * large / 1e9)
    assert optimizer_step_s([small, large, 0], hw) == pytest.approx(
        2 * small / 4e9 + 2 * large / 1e9
    )
    roofline = get_hardware("rtx2080ti")
    bw = roofline.memory_bandwidth * roofline.efficiency
    assert optimizer_step_s([large], roofline) == pytest.approx(2 * large / bw)


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_the_cost_model_counts_the_state_the_runtimes_optimizer_keeps(name):
    """After one step, the optimizer's state tensors (its step counters left out) hold as
    many elements as the memory model charges, for a matrix, a vector and a 3-d tensor."""
    import torch
    from ftpipe_runtime.train.optim import make_optimizer

    shapes = [(6, 10), (7,), (2, 3, 5)]
    params = [torch.nn.Parameter(torch.randn(s)) for s in shapes]
    opt = make_optimizer(name, params, 1e-3)
    for p in params:
        p.grad = torch.randn_like(p)
    opt.step()
    for p, shape in zip(params, shapes):
        kept = sum(
            t.numel()
            for key, t in opt.state[p].items()
            if torch.is_tensor(t) and key != "step" and t.dim() > 0
        )
        assert kept == optimizer_state_elements(shape, name), (name, shape)
