"""The offload section's planning row and its markdown, on a model that fits only with offload
(2.15 B fp32 parameters, traced on the meta device, on 2 x rtx2080ti)."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks.offload.bench import markdown, plan_row
from ftpipe_compiler.costs.profilers import costed_graph


@pytest.fixture(scope="module")
def wide(request):
    import sys

    sys.path.insert(0, str(Path(__file__).parents[1]))  # zoo_fixtures
    return costed_graph("zoo_fixtures:wide_model", hardware="rtx2080ti", granularity="layer")[3]


def test_a_row_that_fits_only_offloaded_says_what_and_how_much(wide):
    row = plan_row(wide, "rtx2080ti", 2)
    # (each stage's optimizer on the host; its gradients summed on the GPU where that fits)
    assert row["feasible"] and all(o.startswith("optimizer") for o in row["offload"])
    assert len(row["offload"]) == 2
    assert all(b <= row["memory_bytes"] for b in row["gpu_memory_bytes"])
    assert row["host_memory_bytes"][0] <= row["host_capacity_bytes"]
    assert row["host_bytes_down_per_step"] >= row["host_bytes_up_per_step"] > 0  # grads, weights
    assert row["cpu_step_s"] > 0 and 0.0 <= row["cpu_step_hidden"] <= 1.0
    # The same search with --offload-step lagged: its own plan, never slower than exact
    # under the same schedule (its steps land later, the actions before them never wait).
    lag = row["lagged"]
    assert 0.0 <= lag["cpu_step_hidden"] <= 1.0 and lag["samples_per_s"] > 0
    if lag["schedule"] == row["schedule"] == "ftpipe":
        assert lag["cpu_step_hidden"] >= row["cpu_step_hidden"]
    case = {"model": "wide", "task": "t", "gpus": 2, "hardware": "rtx2080ti",
            "rows": [{"label": "full", **row},
                     {"label": "none", "feasible": False, "static_floor_bytes_per_gpu": 2**34}]}  # fmt: skip
    runs = {n: {"median_step_s": s, "step_s": s, "step_std_s": 0.01, "memory_bytes": [2**28],
                "other_cores": [0.1]} for n, s in (("plain", 1.0), ("offloaded", 1.1))}  # fmt: skip
    text = markdown({"plans": [case], "overhead": {"model": "m", "seq_len": 8, "stages": 2,
                                                   "runs": runs, "overhead": 0.1,
                                                   "same_losses": True}})  # fmt: skip
    assert "| wide (t), 2 x rtx2080ti | full | yes |" in text
    assert "0@0: optimizer" in text and "1@1: optimizer" in text
    assert "| none | no (floor 16.0 GiB per GPU)" in text
    hidden = f"({lag['cpu_step_hidden']:.0%})"
    assert f"| {lag['samples_per_s']:.3f} {hidden}" in text
    assert "+10%" in text and "the same bit for bit" in text
