"""The run's log: JSON lines rewritten whole, TensorBoard scalars where tensorboard is installed."""

from __future__ import annotations

import json

import pytest
from ftpipe_runtime.job.runlog import RunLog


def test_json_lines_and_scalars(tmp_path):
    log = RunLog(tmp_path, rank=0, flush_s=0.0)
    log.record("train", 1, loss=4.5, lr=1e-3, samples_per_s=10.0)
    assert json.loads(log.path.read_text()) == {  # on disk at once with flush_s=0
        "kind": "train", "step": 1, "loss": 4.5, "lr": 1e-3, "samples_per_s": 10.0
    }  # fmt: skip
    log.flush_s = 3600.0
    log.record("eval", 5, loss=3.25, perplexity=25.79)
    log.memory(5, {"allocated": 2**30, "reserved": 2**31})
    assert len(log.path.read_text().splitlines()) == 1  # not yet: at most every flush_s
    log.close()
    lines = [json.loads(x) for x in log.path.read_text().splitlines()]
    assert [(x["kind"], x["step"]) for x in lines] == [("train", 1), ("eval", 5)]
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp_path / "tensorboard" / "rank-0"))
    events.Reload()
    assert [e.value for e in events.Scalars("eval/loss")] == [3.25]
    assert [e.step for e in events.Scalars("train/lr")] == [1]
    assert [e.value for e in events.Scalars("memory/allocated_GiB")] == [1.0]
    assert [e.value for e in events.Scalars("memory/reserved_GiB")] == [2.0]


def test_other_ranks_write_only_their_memory(tmp_path):
    log = RunLog(tmp_path, rank=1, flush_s=0.0)
    log.record("train", 1, loss=4.5)
    log.close()
    assert not log.path.exists()
