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
        # the micro-batches' shares of the step's loss (they add up to it), then the seconds
        progress.loss(step, torch.tensor([0.5, 1.0, 0.5 * (step + 1)]))
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
