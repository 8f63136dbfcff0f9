"""`make gpu-check` on a CPU (its small version), from a bare checkout as the GPU machine
has it: every part passed or was skipped with a reason, and the report says so; the parts'
fencing (a failure, a timeout, a skip stay each part's own); the calibration it proposes and
writing it into a hardware file."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from benchmarks.gpu_check import parts as _parts  # noqa: F401 - registers every part
from benchmarks.gpu_check import registry
from benchmarks.gpu_check.calibration import applied, propose
from benchmarks.gpu_check.registry import Check, Skip, run_parts
from benchmarks.gpu_check.report import markdown
from benchmarks.gpu_check.sizes import SIZES

ROOT = Path(__file__).resolve().parents[2]

# The child imports nothing installed from this repository: the editable install's finder
# is dropped, as the GPU machine has none, so the bootstrap must map ftpipe_runtime itself.
BARE = (
    "import sys\n"
    "sys.meta_path[:] = [f for f in sys.meta_path if '__editable__' not in "
    "getattr(f, '__module__', '')]\n"
    "sys.modules.pop('ftpipe_runtime', None)\n"
    "from benchmarks.gpu_check.__main__ import main\n"
    "sys.exit(main(sys.argv[1:]))\n"
)


@pytest.mark.slow
def test_the_cpu_version_runs_every_part_from_a_bare_checkout(tmp_path):
    out = tmp_path / "GPU_CHECK.md"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    env.pop("PYTHONPATH", None)
    start = time.monotonic()  # --slack: the shared test machine is often several times slower
    proc = subprocess.run(
        [
            sys.executable,
            "-c",
            BARE,
            "--device",
            "cpu",
            "--out",
            str(out),
            "--work",
            str(tmp_path / "work"),
            "--budget",
            "900",
            "--slack",
            "8",
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=1000,
    )  # fmt: skip
    seconds = time.monotonic() - start
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(out.with_suffix(".json").read_text())
    assert report["kind"] == "ftpipe-gpu-check" and report["device"] == "cpu"
    assert [p["name"] for p in report["parts"]] == list(registry.PARTS) != []
    for p in report["parts"]:
        assert p["status"] in ("passed", "skipped"), (p["name"], p.get("reason"), p["problems"])
        assert p["status"] == "passed" or p["reason"], p["name"]
        assert p["seconds"] <= p["budget_s"] + 1
    env_part = report["parts"][0]["figures"]
    assert any("the checkout's runtime/" in line for line in env_part["setup"])
    runs = next(p for p in report["parts"] if p["name"] == "schedules")["figures"]["runs"]
    assert {r["status"] for r in runs.values()} == {"ran"}  # every schedule, none refused
    text = out.read_text()
    for p in report["parts"]:
        assert f"| {p['name']} | {p['status']} |" in text
    assert report["calibration"] is None  # nothing measured on a GPU: nothing proposed
    assert "[gpu-check +" in proc.stderr  # progress with timestamps
    print(f"the CPU version took {seconds:.0f} s")  # ~40 s on an idle 2-core machine


@pytest.fixture
def parts(monkeypatch):
    """A registry of our own for the fencing tests."""
    table = {}
    monkeypatch.setattr(registry, "PARTS", table)
    return table


def _check(tmp_path, budget=30.0) -> Check:
    return Check("cpu", SIZES["cpu"], tmp_path, time.monotonic() + budget)


def test_a_failing_part_is_recorded_and_the_next_one_runs(parts, tmp_path, monkeypatch):
    @registry.part("boom", "raises", cuda_s=5, cpu_s=5)
    def boom(check, found):
        found["before"] = 1
        raise ValueError("bad thing")

    @registry.part("slow", "sleeps past its budget", cuda_s=0.5, cpu_s=0.5)
    def slow(check, found):
        time.sleep(5)

    @registry.part("skip", "cannot run here", cuda_s=5, cpu_s=5)
    def skip(check, found):
        raise Skip("no such thing here")

    @registry.part("checks", "one check fails", cuda_s=5, cpu_s=5)
    def checks(check, found):
        found.expect(1 + 1 == 2, "arithmetic")
        found.expect(False, "this one")

    @registry.part("fine", "passes", cuda_s=5, cpu_s=5)
    def fine(check, found):
        found["x"] = 2

    monkeypatch.setattr(registry, "MIN_BUDGET_S", 0.1)
    rows = {r["name"]: r for r in run_parts(_check(tmp_path), list(parts))}
    assert rows["slow"]["seconds"] < 2  # interrupted at its budget, not slept out
    assert rows["boom"]["status"] == "error" and "ValueError: bad thing" in rows["boom"]["reason"]
    assert rows["boom"]["figures"] == {"before": 1}
    assert rows["slow"]["status"] == "timed out"
    assert rows["skip"]["status"] == "skipped" and rows["skip"]["reason"] == "no such thing here"
    assert rows["checks"]["status"] == "failed" and rows["checks"]["problems"] == ["this one"]
    assert rows["fine"]["status"] == "passed" and rows["fine"]["figures"] == {"x": 2}


def test_parts_past_the_whole_budget_are_skipped_saying_so(parts, tmp_path):
    @registry.part("late", "no time left", cuda_s=5, cpu_s=5)
    def late(check, found):
        raise AssertionError("must not run")

    @registry.part("needs", "a module that is not here", cuda_s=5, cpu_s=5,
                   needs=("no_such_module_here",))  # fmt: skip
    def needs(check, found):
        raise AssertionError("must not run")

    (late_row,) = run_parts(_check(tmp_path, budget=0.0), ["late"])
    assert late_row["status"] == "skipped" and "out of time" in late_row["reason"]
    (row,) = run_parts(_check(tmp_path), ["needs"])
    assert row["status"] == "skipped" and "no_such_module_here" in row["reason"]


def test_a_part_needing_the_compiler_is_skipped_without_pymetis(parts, tmp_path, monkeypatch):
    """The GPU machine has no pymetis, which the compiler imports: say so, and how to carry it."""
    from benchmarks.gpu_check import bootstrap

    real = bootstrap.missing
    monkeypatch.setattr(bootstrap, "missing", lambda *n: real(*n) + ["pymetis"] * ("pymetis" in n))

    @registry.part("compiles", "needs the compiler", cuda_s=5, cpu_s=5, needs=("compiler",))
    def compiles(check, found):
        raise AssertionError("must not run")

    (row,) = run_parts(_check(tmp_path), ["compiles"])
    assert row["status"] == "skipped" and "pymetis" in row["reason"]
    assert "make gpu-wheels" in row["reason"]


def _gpu_parts(simulated=0.5, measured=0.8) -> list[dict]:
    rates = {
        "gemm_n": 8192,
        "gemm_tflops": {"bfloat16": 700.0, "float32": 50.0, "tf32": 350.0},
        "memory_bandwidth": 3.0e12,
        "host_to_device": 5.0e10,
        "device_to_host": 5.1e10,
        "op_overhead_s": 6.123e-6,
        "optimizer_bandwidth": 1.5e12,
    }
    llama = {"model": "llama-3.2-1b", "stages": 2, "dtype": "bf16", "efficiency": 0.5,
             "simulated_step_s": simulated, "measured_step_s": measured}  # fmt: skip
    return [
        {"name": "environment", "status": "passed",
         "figures": {"torch": "2.11.0", "gpu": {"name": "NVIDIA H100 80GB HBM3"}}},
        {"name": "rates", "status": "passed", "figures": rates},
        {"name": "llama", "status": "passed", "figures": llama},
    ]  # fmt: skip


def test_the_calibration_fits_efficiency_to_the_measured_step():
    """The roofline's times scale as 1 / efficiency: efficiency x simulated / measured makes
    the simulated step the measured one."""
    from ftpipe_compiler.costs.hardware import Hardware, get_hardware

    calib = propose(_gpu_parts(simulated=0.5, measured=0.8), "h100-80gb", "2026-11-27")
    assert calib["proposed"]["efficiency"] == pytest.approx(0.5 * 0.5 / 0.8, abs=1e-3)
    assert calib["proposed"]["kernel_overhead_s"] == 6.12e-6
    old = get_hardware("h100-80gb")
    hw = Hardware.from_json(applied(old.to_json() | {"sources": ["a"]}, calib))
    flops = 1e15  # compute-bound: the roofline's time is flops / (peak x efficiency)
    ratio = (hw.op_time(flops, 0, "bfloat16") - hw.kernel_overhead_s) / (
        old.op_time(flops, 0, "bfloat16") - old.kernel_overhead_s
    )
    assert ratio == pytest.approx(0.8 / 0.5, rel=2e-3)
    assert propose(_gpu_parts()[:1], "h100-80gb", "2026-11-27") is None  # no rates: none


def test_apply_writes_the_proposal_into_the_hardware_file(tmp_path, monkeypatch):
    from benchmarks.gpu_check import apply

    folder = tmp_path / "configs" / "hardware"
    folder.mkdir(parents=True)
    original = json.loads((ROOT / "configs" / "hardware" / "h200.json").read_text())
    (folder / "h200.json").write_text(json.dumps(original))
    monkeypatch.setattr(apply, "ROOT", tmp_path)
    report = tmp_path / "GPU_CHECK.json"
    report.write_text(json.dumps({"calibration": propose(_gpu_parts(), "h200", "2026-11-27")}))
    assert apply.main([str(report), "--write", "h200"]) == 0
    hw = json.loads((folder / "h200.json").read_text())
    assert hw["efficiency"] == round(0.5 * 0.5 / 0.8, 3)
    assert hw["calibration"]["date"] == "2026-11-27"
    assert hw["peak_flops_tf32"] == original["peak_flops_tf32"]  # datasheet peaks kept
    assert hw["sources"][-1].startswith("calibrated on 2026-11-27 on an NVIDIA H100")
    assert apply.main([str(report), "--write", "no-such-gpu"]) == 1
    report.write_text(json.dumps({"calibration": None}))
    assert apply.main([str(report), "--write", "h200"]) == 1


def test_the_markdown_lists_every_part_and_its_problems():
    rows = [
        {"name": "environment", "title": "Environment", "status": "passed", "seconds": 1.0,
         "budget_s": 10, "problems": [], "figures": {"torch": "2.11.0"}},
        {"name": "llama", "title": "Llama", "status": "failed", "seconds": 9.0, "budget_s": 90,
         "problems": ["allocated 9 GiB, planned 7 GiB"], "figures": {"x": 0.5}},
    ]  # fmt: skip
    text = markdown({"command": "x", "date": "d", "device": "cpu", "budget_s": 100,
                     "wall_s": 10, "parts": rows, "calibration": None})  # fmt: skip
    assert "| llama | failed | 9.0 | 90 | allocated 9 GiB, planned 7 GiB |" in text
    assert "- PROBLEM: allocated 9 GiB" in text and "1 passed, 1 failed" in text


def test_the_gpu_hosts_cpu_rates_go_into_the_host_section(tmp_path):
    """The offload model's CPU side measured on the GPU's host: the better of one thread and
    all cores for the step and the sums, the slower pinned copy for the link; the node's
    figures not measured (one GPU) stay."""
    from ftpipe_compiler.costs.hardware import Hardware, get_hardware

    parts = _gpu_parts()
    parts[1]["figures"]["host"] = {
        "threads_1": {"step_bandwidth": 4e9, "sum_bandwidth": 6e9, "copy_bandwidth": 9e9},
        "threads_16": {"step_bandwidth": 2.04e10, "sum_bandwidth": 3e9, "copy_bandwidth": 3e10},
    }
    calib = propose(parts, "h200", "2026-11-27")
    assert calib["proposed"]["host"] == {
        "step_bandwidth": 2.04e10, "sum_bandwidth": 6e9, "link_bandwidth": 5e10}  # fmt: skip
    old = get_hardware("h200").to_json()
    hw = applied(old, calib)
    assert hw["host"]["node_bandwidth"] == old["host"]["node_bandwidth"]
    assert hw["host"]["step_bandwidth"] == 2.04e10 and "host step_bandwidth" in hw["sources"][-1]
    Hardware.from_json(hw)  # still a hardware file
    assert "host" not in propose(_gpu_parts(), "h200", "2026-11-27")["proposed"]
