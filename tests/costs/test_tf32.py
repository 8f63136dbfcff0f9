"""fp32 costs at the rate the run computes fp32 at: TF32 tensor cores on Ampere and later
(the runtime's --tf32, its default), the plain fp32 units otherwise."""

from __future__ import annotations

import json

import pytest

from ftpipe_compiler.costs.hardware import get_hardware
from ftpipe_compiler.resources import config_names, configs_dir

AMPERE_AND_LATER = ("a100-40gb", "a100-80gb", "a10g", "h100-80gb", "h200", "l4", "l40s",
                    "rtx3090", "rtx4090")  # fmt: skip


def _compute_s(hw, dtype="float32", flops=1e15):
    return hw.op_time(flops, 0, dtype) - hw.kernel_overhead_s


def test_an_h100_runs_fp32_products_at_tf32s_rate_unless_told_not_to():
    """495 dense TF32 TFLOP/s against 67 fp32: a plan for a run with --no-tf32 is 7.4x
    slower in fp32, and bf16 (its own tensor cores) does not change."""
    on, off = get_hardware("h100-80gb"), get_hardware("h100-80gb", tf32=False)
    assert on.peak("float32") == 495e12 and off.peak("float32") == 67e12
    assert _compute_s(off) == pytest.approx(_compute_s(on) * 495 / 67)
    assert _compute_s(off, "bfloat16") == _compute_s(on, "bfloat16")


def test_gpus_before_ampere_have_no_tf32():
    for name in ("v100-32gb", "rtx2080ti", "quadro-rtx5000"):
        hw = get_hardware(name)
        assert hw.peak_flops_tf32 == 0 and hw.peak("float32") == hw.peak_flops


def test_every_file_says_both_fp32_rates_where_the_gpu_has_tf32():
    names = set(config_names("hardware"))
    assert set(AMPERE_AND_LATER) <= names
    for name in names:
        d = json.loads((configs_dir() / "hardware" / f"{name}.json").read_text())
        if name in AMPERE_AND_LATER:
            assert d["peak_flops_tf32"] >= d["peak_flops"] > 0, name
            assert "peak_flops_tf32" in d["description"], name
        else:
            assert "peak_flops_tf32" not in d, name
