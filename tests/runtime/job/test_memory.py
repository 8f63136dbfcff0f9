"""The memory meter (`ftpipe_runtime.job.memory`): a rank's own peak, measured from a start
taken after torch's lazily loaded parts, once per device."""

from __future__ import annotations

import subprocess
import sys

import torch
from ftpipe_runtime.job import memory
from ftpipe_runtime.job.memory import memory_meter


def test_one_meter_per_device_started_with_the_first_callers_dtype(monkeypatch):
    monkeypatch.setattr(memory, "_METERS", {})
    started = []
    monkeypatch.setattr(memory, "_load_lazy_parts", started.append)
    first = memory_meter("cpu", dtype=torch.bfloat16)
    assert memory_meter("cpu") is first and memory_meter("cpu", dtype=torch.float16) is first
    assert started == [torch.bfloat16]


def test_the_lazy_step_runs_in_every_compute_dtype():
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        memory._load_lazy_parts(dtype)  # a kernel missing for a dtype would raise here


def test_allocated_is_what_the_run_added_since_the_start():
    """A 64 MiB tensor made and written after the start is counted, with little slack; the
    interpreter and torch, loaded before, are not (a fresh process: the test suite's own
    peak would hide the tensor)."""
    code = (
        "import torch; from ftpipe_runtime.job.memory import Memory\n"
        "meter = Memory('cpu', torch.bfloat16)\n"
        "held = torch.ones(16 * 2**20)\n"  # 64 MiB, every page written
        "print(meter.peaks()['allocated'], meter.peaks()['reserved'])"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    allocated, reserved = map(int, out.stdout.split())
    assert 64 * 2**20 <= allocated < 72 * 2**20, allocated
    assert reserved > allocated + 100 * 2**20  # torch alone is ~300 MiB


def test_a_ranks_peak_is_its_own_not_its_launchers():
    """A rank's peak memory is its own: getrusage's ru_maxrss of a process started by fork or
    vfork and exec starts at its parent's peak (torchrun's agent; here pytest holding 1 GiB),
    which made every rank of a test run late in the suite "peak" 578 MiB instead of 262."""
    held = bytearray(1 << 30)
    held[:: 1 << 12] = b"\1" * len(range(0, len(held), 1 << 12))  # resident, page by page
    code = "from ftpipe_runtime.job.memory import peak_resident_bytes as p; print(p())"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert int(out.stdout) < 900 * 2**20, out.stdout  # torch alone is ~300 MiB
    del held
