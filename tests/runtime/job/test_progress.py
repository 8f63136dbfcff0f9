"""What rank 0 tells its user: a progress bar only on a terminal, plain step lines otherwise."""

from __future__ import annotations

import io
import re
import sys

import pytest
import torch
from ftpipe_runtime.job.logs import setup_logging
from ftpipe_runtime.job.report import Progress, Rates


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


class _Log:
    """What a RunLog is given."""

    def __init__(self):
        self.rows = []

    def record(self, kind, step, **figures):
        self.rows.append((kind, step, figures))


def _two_steps(monkeypatch, stream, **options) -> Progress:
    monkeypatch.setattr(sys, "stderr", stream)
    setup_logging(0, options.pop("verbosity", 0))
    progress = Progress(True, steps=2, first=0, samples_per_step=4, **options)
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
    assert all(re.match(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d rank 0 INFO ", x) for x in lines), lines
    assert [line.split("INFO    ")[1].split("  ")[:2] for line in lines] == [
        ["step 1/2", "loss 1.5000"],
        ["step 2/2", "loss 1.5000"],
    ]
    assert "\r" not in out.getvalue()  # no bar redrawing


def test_quiet_prints_no_step_lines_and_no_bar(monkeypatch):
    out = _Terminal()
    progress = _two_steps(monkeypatch, out, verbosity=-1, bar=False)
    assert progress.bar is None and out.getvalue() == ""
    assert progress.losses == {0: 1.5, 1: 1.5}  # still kept for the summary


def test_figures_of_a_step(monkeypatch):
    """Rates from a step's time: tokens/s, MFU (the plan's FLOPs against the peak), the time
    left; the gradient norm waits for the step that computed it."""
    out = io.StringIO()
    monkeypatch.setattr(sys, "stderr", out)
    setup_logging(0)
    rates = Rates(tokens_per_step=64, flops_per_step=2e9, peak_flops=1e12)
    progress = Progress(True, 4, 0, 4, rates=rates, memory=lambda: 3 * 2**20, norms=True)
    progress.lr_of = lambda k: 1e-3 * (k + 1)
    progress.log = log = _Log()
    progress.loss(0, torch.tensor([0.5, 1.5, 0.5]))  # shares 0.5 and 1.5 of loss 2, at 0.5 s
    assert out.getvalue() == ""  # its gradient norm is not in yet
    progress.grad_norm(0, torch.tensor(9.0))  # squared
    assert [(kind, step) for kind, step, _ in log.rows] == [("train", 1)]
    f = log.rows[0][2]
    assert f["loss"] == 2.0 and f["lr"] == 1e-3 and f["grad_norm"] == 3.0
    assert f["samples_per_s"] == 8.0 and f["tokens_per_s"] == 128.0  # 4 samples, 64 tokens in 0.5 s
    assert f["mfu"] == pytest.approx(2e9 * 2 / 1e12)  # 2 steps/s of 2 GFLOP on 1 TFLOP/s
    assert f["eta_s"] == pytest.approx(1.5) and f["peak_memory_bytes"] == 3 * 2**20
    line = out.getvalue()
    for part in ("step 1/4", "loss 2.0000", "lr 1.000e-03", "grad_norm 3", "128 tokens/s",
                 "8.0 samples/s", "mem 3.0 MiB", "eta 0:00:02", "mfu 0.4%"):  # fmt: skip
        assert part in line, (part, line)
    progress.loss(1, torch.tensor([1.0, 1.0, 1.0]))
    progress.close()  # at the end, a step whose norm never came is said without one
    assert "grad_norm" not in log.rows[1][2] and "step 2/4" in out.getvalue()


def test_a_bar_on_a_terminal(monkeypatch):
    out = _Terminal()
    progress = _two_steps(monkeypatch, out)
    assert progress.bar is not None
    assert "steps" in out.getvalue() and "step 2/2  loss 1.5000" in out.getvalue()
