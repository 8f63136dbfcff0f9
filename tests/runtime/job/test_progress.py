"""What rank 0 tells its user: a progress bar only on a terminal, plain step lines otherwise."""

from __future__ import annotations

import io
import sys

import torch
from ftpipe_runtime.job.report import Progress


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def _two_steps(monkeypatch, stream) -> Progress:
    monkeypatch.setattr(sys, "stderr", stream)
    progress = Progress(True, steps=2, first=0, samples_per_step=4)
    for step in range(2):
        progress.loss(step, torch.tensor([1.0, 2.0, 0.5 * (step + 1)]))
    progress.close()
    return progress


def test_plain_lines_when_stderr_is_not_a_terminal(monkeypatch):
    out = io.StringIO()
    progress = _two_steps(monkeypatch, out)
    assert progress.bar is None
    lines = out.getvalue().splitlines()
    assert [line.split("  ")[:2] for line in lines] == [
        ["step 1/2", "loss 1.5000"],
        ["step 2/2", "loss 1.5000"],
    ]
    assert "\r" not in out.getvalue()  # no bar redrawing


def test_a_bar_on_a_terminal(monkeypatch):
    out = _Terminal()
    progress = _two_steps(monkeypatch, out)
    assert progress.bar is not None
    assert "steps" in out.getvalue() and "step 2/2  loss 1.5000" in out.getvalue()


def test_a_ranks_peak_is_its_own_not_its_launchers():
    """A rank's peak memory is its own: getrusage's ru_maxrss of a process started by fork or
    vfork and exec starts at its parent's peak (torchrun's agent; here pytest holding 1 GiB),
    which made every rank of a test run late in the suite "peak" 578 MiB instead of 262."""
    import subprocess
    import sys

    held = bytearray(1 << 30)
    held[:: 1 << 12] = b"\1" * len(range(0, len(held), 1 << 12))  # resident, page by page
    code = "from ftpipe_runtime.job.report import peak_resident_bytes as p; print(p())"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert int(out.stdout) < 900 * 2**20, out.stdout  # torch alone is ~300 MiB
    del held
