"""Shared fixtures: a seed, and traced tiny models (traced once per session: tracing takes seconds)."""

from __future__ import annotations

import random
import signal

import pytest
import torch
from tiny_disk import tiny_disk  # noqa: F401 - a real full disk (a small tmpfs), for any test

from ftpipe_compiler.costs.analytic import analytic_costs
from ftpipe_compiler.costs.hardware import get_hardware
from ftpipe_compiler.graph.trace import trace_model
from ftpipe_compiler.model.tasks import resolve_task
from ftpipe_compiler.model.zoo import resolve_model

# A shell starts a background job (`make test &`) with SIGINT ignored, and Python then leaves
# Ctrl-C ignored too: the tests that send it would see nothing arrive.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


@pytest.fixture
def seed() -> int:
    random.seed(0)
    torch.manual_seed(0)
    return 0


def _traced(name: str):
    spec = resolve_model(name)
    task = resolve_task(spec, None)
    model = spec.build("cpu", dropout=0.0, seed=0)
    traced = trace_model(spec, task, task.micro_batch, device="cpu", model=model)
    return spec, task, model, traced


@pytest.fixture(scope="session")
def tiny_t5():
    return _traced("t5-tiny")


@pytest.fixture(scope="session")
def tiny_gpt2():
    return _traced("gpt2-tiny")


@pytest.fixture(scope="session")
def tiny_bert():
    return _traced("bert-tiny")


@pytest.fixture(scope="session")
def tiny_t5_costed(tiny_t5):
    return analytic_costs(tiny_t5[3], get_hardware("rtx2080ti"))
