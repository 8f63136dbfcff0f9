"""What goes wrong in tracing is said in one line: the user's own code, a loss that is not a
scalar, and a Ctrl-C (an interruption, even when the exporter wraps it in an error of its own)."""

from __future__ import annotations

import os
import signal

import torch
from click.testing import CliRunner

from ftpipe_compiler.cli import cli


def _profile(model):
    return CliRunner().invoke(cli, ["profile", "--model", model])


def _one_line(r, code=1):
    assert r.exit_code == code, r.output
    assert r.output.count("\n") == 1 and "Traceback" not in r.output, r.output
    return r.output


def test_the_users_function_and_forward_are_named_as_the_culprits():
    out = _one_line(_profile("zoo_fixtures:raising_model"))
    assert "your model function zoo_fixtures:raising_model raised ValueError: no weights" in out
    out = _one_line(_profile("zoo_fixtures:forward_raises_model"))
    assert "your model's forward raised RuntimeError: this model only runs on Tuesdays" in out


def test_a_forward_that_returns_no_scalar_is_refused_at_compile_time(tmp_path):
    r = CliRunner().invoke(
        cli,
        ["compile", "-m", "zoo_fixtures:vector_model", "--gpus", "2", "-o", str(tmp_path / "o")],
    )
    out = _one_line(r)
    assert "returns a float32 of shape (4,), not a scalar loss" in out
    assert not (tmp_path / "o").exists()


def test_ctrl_c_while_tracing_is_an_interruption(monkeypatch):
    def exporter_that_wraps_the_interrupt(*args, **kwargs):
        try:
            os.kill(os.getpid(), signal.SIGINT)  # the user presses Ctrl-C mid-export ...
            for _ in range(1000):
                pass
        except KeyboardInterrupt as e:  # ... and the exporter turns it into its own error
            raise RuntimeError("failed while running the model") from e
        raise AssertionError("SIGINT was not delivered")

    monkeypatch.setattr(torch.export, "export", exporter_that_wraps_the_interrupt)
    before = signal.getsignal(signal.SIGINT)  # SIG_IGN where a shell started us in background
    out = _one_line(_profile("gpt2-tiny"), code=130)
    assert out.startswith("Interrupted (Ctrl-C)") and "could not trace" not in out
    assert signal.getsignal(signal.SIGINT) is before  # the handler restored
