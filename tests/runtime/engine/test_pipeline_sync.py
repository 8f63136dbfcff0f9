"""The synchronous schedules train exactly like the unpartitioned model, step after step, on
samples of different lengths (a step's loss: its label tokens' mean, not a mean of
per-micro-batch means).

Zero-bubble ones split each backward into B and W (zb1p on any placement, zbv in its V:
the toy's "folded" layout; zb2p steps each stage on its own, no flush, so its gradients are
clipped per stage: compared without clipping); interleaved runs the toy's loop of two
chunks per rank.
"""

from __future__ import annotations

import json

import pytest
import torch
from ftpipe_runtime.schedules import actions, write_lists
from ftpipe_runtime.spec.topology import Topology
from runtime_reference import checkpoint_params, train_plain
from runtime_toy import toy_plan, write_ragged

pytestmark = pytest.mark.multiproc

STEPS = 3


@pytest.mark.parametrize(
    ("schedule", "layout", "optimizer", "clip"),
    [
        ("gpipe", "two-ranks", "adamw", 1.0),
        ("1f1b", "three-ranks", "sgd", 0.5),
        ("csv", "two-ranks", "adamw", 1.0),
        ("zb1p", "three-ranks", "adamw", 1.0),
        ("zbv", "folded", "adamw", 1.0),
        ("interleaved", "two-ranks", "sgd", 0.5),
        ("zb2p", "two-ranks", "adamw", 0.0),
    ],
)
def test_sync_schedule_matches_plain_training(
    run_pipeline, tmp_path, schedule, layout, optimizer, clip
):
    plan = toy_plan(layout, "gpipe" if schedule == "csv" else schedule)
    ckpt, log = tmp_path / "ckpt", tmp_path / "log.json"
    if schedule == "csv":  # a schedule written as a file: one step of 1F1B, per GPU
        schedule = str(tmp_path / "one-step.csv")
        lists = actions("1f1b", Topology(plan).stage_infos(), plan["micro_batches"], 1)
        write_lists(lists, schedule)
    argv = ["--steps", str(STEPS), "--optimizer", optimizer, "--lr", "0.05", "--clip", str(clip)]
    argv += ["--schedule", schedule, "--data", write_ragged(tmp_path / "ragged.jsonl")]
    argv += ["--save-every", "1", "--checkpoint-dir", str(ckpt), "--log-json", str(log)]
    codes, ranks = run_pipeline(plan, argv)
    assert codes == [0] * plan["gpus"], ranks.stderr()

    losses, params = train_plain(
        plan, STEPS, optimizer, lr=0.05, clip=clip, data=str(tmp_path / "ragged.jsonl")
    )
    got = json.loads(log.read_text())
    assert got["losses"] == pytest.approx(losses, rel=1e-4)
    for step in range(STEPS):
        pipeline = checkpoint_params(ckpt, step + 1, range(4))
        assert pipeline.keys() == params[step].keys()
        for name, value in params[step].items():
            torch.testing.assert_close(pipeline[name], value, rtol=1e-4, atol=1e-6, msg=name)
