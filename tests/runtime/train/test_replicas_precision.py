"""Data parallelism under bf16 and fp16 (fp32 master weights, gradients summed in fp32):
2 replicas train as one process on the whole batch in the same precision, and the replicas
keep bit-identical weights; with a split backward (zero-bubble schedules, whose weight
passes hand their gradients to the masters) too. The reference is the runtime on one rank
without replicas, twice the micro-batches a step; single-process bf16 training against
HuggingFace's is test_finetune's."""

from __future__ import annotations

import json

import pytest
import torch
from ftpipe_runtime import run
from runtime_reference import checkpoint_params
from runtime_toy import STAGES, one_rank_plan, toy_plan

pytestmark = pytest.mark.multiproc

STEPS, M = 3, 2
DTYPES = {"bf16": "bfloat16", "fp16": "float16"}


def replicated(schedule: str, dtype: str, gpus: int) -> dict:
    """2 replicas of the toy on `gpus` GPUs each (1: all four stages on one rank)."""
    made = one_rank_plan if gpus == 1 else lambda *a: toy_plan("two-ranks", *a)
    plan = made(schedule, M, DTYPES[dtype])
    placement = [[r, g] for r in range(2) for g in range(gpus)]
    return {**plan, "replicas": 2, "placement": placement}


def argv(dtype, schedule, optimizer, clip, ckpt, log) -> list[str]:
    out = ["--steps", str(STEPS), "--optimizer", optimizer, "--lr", "0.05", "--clip", str(clip)]
    out += ["--dtype", dtype, "--schedule", schedule, "--save-every", "1"]
    return out + ["--checkpoint-dir", str(ckpt), "--log-json", str(log)]


@pytest.mark.parametrize(
    ("dtype", "schedule", "gpus", "optimizer", "clip"),
    [
        ("bf16", "gpipe", 1, "adamw", 1.0),
        ("fp16", "1f1b", 1, "sgd", 0.5),
        ("bf16", "zb1p", 2, "adamw", 1.0),  # split backward: W hands gradients to the masters
        ("bf16", "zb2p", 2, "sgd", 0.0),  # ... and set-aside weight versions' gradients
    ],
)
def test_replicas_in_16_bits_train_as_one_process(
    run_pipeline, tmp_path, dtype, schedule, gpus, optimizer, clip
):
    plan = replicated(schedule, dtype, gpus)
    ckpt, log = tmp_path / "ckpt", tmp_path / "log.json"
    codes, ranks = run_pipeline(plan, argv(dtype, schedule, optimizer, clip, ckpt, log))
    assert codes == [0] * (2 * gpus), ranks.stderr()
    got = json.loads(log.read_text())
    assert got["dtype"] == dtype
    assert got["replica_difference"] == 0.0  # the replicas hold the very same weights

    one = one_rank_plan("gpipe", 2 * M, DTYPES[dtype])
    ref_ckpt, ref_log = tmp_path / "ref-ckpt", tmp_path / "ref.json"
    want = run(one, STAGES, argv(dtype, "gpipe", optimizer, clip, ref_ckpt, ref_log))
    assert got["losses"] == pytest.approx(want["losses"], rel=1e-2)  # 8 bits of mantissa
    for step in range(1, STEPS + 1):  # the fp32 masters, as checkpoints keep them
        mine = checkpoint_params(ckpt, step, range(4))
        ref = checkpoint_params(ref_ckpt, step, range(4))
        assert mine.keys() == ref.keys()
        for name, value in ref.items():
            assert mine[name].dtype == torch.float32
            torch.testing.assert_close(mine[name], value, rtol=0, atol=2e-3, msg=name)
