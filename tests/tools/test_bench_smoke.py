"""The benchmark harness of BENCHMARKS.md sections 3-4, on tiny sizes (seconds).

The pieces a benchmark figure rests on, each against a reference: the hand-cut pipelining
stages against the HF model's own loss, the pipelining run against one process, the step
statistics and action summaries against hand computations.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

import pytest
import torch

TOOLS = Path(__file__).resolve().parents[2] / "tools"
sys.path.insert(0, str(TOOLS))

from bench_actions import summarise  # noqa: E402
from bench_launch import flags, step_stats, torchrun  # noqa: E402
from bench_reference import (  # noqa: E402
    Recomputed,
    build_model,
    lm_loss,
    split_stages,
    step_batch,
    train_single,
)
from bench_runtime import blocks_on_first_stage  # noqa: E402

TINY_PLAN = {  # what the benchmark reads from a plan: the model's inputs, micro-batches
    "micro_batches": 2,
    "model": {
        "model_name": "gpt2-tiny",
        "family": "gpt2",
        "vocab_size": 128,
        "micro_batch": 2,
        "inputs": {"input_ids": [[2, 16], "int64"], "labels": [[2, 16], "int64"]},
    },
}


def test_step_stats_times_steps_after_warmup():
    ends = [5.0, 7.0, 8.5, 10.5, 12.0]  # the first step (fill, start-up) is not timed
    s = step_stats(ends, warmup=1, samples_per_step=8)
    assert s["step_times_s"] == [2.0, 1.5, 2.0, 1.5]
    assert s["step_s"] == pytest.approx(1.75)
    assert s["step_std_s"] == pytest.approx(statistics.stdev([2.0, 1.5, 2.0, 1.5]))
    assert s["samples_per_s"] == pytest.approx(8 / 1.75)
    with pytest.raises(ValueError):
        step_stats(ends, warmup=0, samples_per_step=8)


def test_flags():
    assert flags(schedule="1f1b", force=True, cache=False, seq_len=None, micro_batches=4) == [
        "--schedule", "1f1b", "--force", "--no-cache", "--micro-batches", "4",
    ]  # fmt: skip


def test_split_stages_reproduce_the_models_loss_and_gradients(seed):
    model = build_model("gpt2-tiny", seed=seed)
    ids = torch.randint(0, 128, (2, 16))
    expected = model(input_ids=ids, labels=ids, use_cache=False).loss  # HF's own loss
    expected.backward()
    want = model.transformer.h[0].attn.c_attn.weight.grad.clone()
    model.zero_grad()
    first, last = split_stages(model, blocks=1)
    got = lm_loss(Recomputed(last)(Recomputed(first)(ids)), ids)
    got.backward()
    assert got.item() == pytest.approx(expected.item(), rel=1e-6)
    assert torch.allclose(model.transformer.h[0].attn.c_attn.weight.grad, want, atol=1e-6)


def test_blocks_on_first_stage():
    def stage(i, blocks):
        return {"id": i, "params": [f"transformer.h.{b}.mlp.c_fc.weight" for b in blocks]}

    assert blocks_on_first_stage({"stages": [stage(0, [0, 1, 2]), stage(1, [3, 4])]}) == 3
    with pytest.raises(ValueError):
        blocks_on_first_stage({"stages": [stage(0, [0, 2]), stage(1, [1, 3])]})


def test_summarise_excludes_warmup_and_waits():
    rows = [  # kind, stage, mb, start, end, waited; 2 micro-batches a step
        ("F", 0, 0, 0.0, 1.0, 0.0),  # step 0: warm-up
        ("F", 0, 2, 0.0, 0.5, 0.1),
        ("F", 0, 3, 1.0, 1.3, 0.0),
        ("B", 0, 2, 2.0, 3.0, 0.4),
        ("S", 0, 1, 3.0, 3.2, 0.0),
    ]
    out = summarise(rows, micro_batches=2, warmup=1)["0"]
    assert out["F"]["count"] == 2
    assert out["F"]["compute_s"] == pytest.approx((0.4 + 0.3) / 2)
    assert out["F"]["wait_s"] == pytest.approx(0.05)
    assert out["B"]["compute_per_step_s"] == pytest.approx(0.6)
    assert out["S"]["compute_s"] == pytest.approx(0.2)


def test_pipelining_run_starts_at_the_single_process_loss(tmp_path, seed):
    """Two gloo ranks of torch.distributed.pipelining against one process: the same loss at
    step 1, then apart (its LM head and embedding are no longer one parameter)."""
    plan, weights = tmp_path / "plan.json", tmp_path / "w.pt"
    plan.write_text(json.dumps(TINY_PLAN))
    torch.save(build_model("gpt2-tiny", seed).state_dict(), weights)
    result = tmp_path / "pipelining.json"
    args = [TOOLS / "bench_pipelining.py"] + flags(
        plan=plan, weights=weights, blocks=1, schedule="1f1b", steps=2, lr=1e-2, result=result
    )
    torchrun(args, tmp_path / "pipelining.log")
    piped = json.loads(result.read_text())
    single = train_single(TINY_PLAN, str(weights), steps=2, lr=1e-2, seed=0)
    assert piped["losses"][0] == pytest.approx(single["losses"][0], rel=1e-6)
    assert abs(piped["losses"][1] - single["losses"][1]) > 1e-5
    assert len(piped["step_ends_s"]) == 2


def test_step_batch_stacks_the_runtimes_micro_batches():
    from ftpipe_runtime.data import make_data

    data = make_data(TINY_PLAN["model"], None, 0)
    ids, labels = step_batch(data, step=1, micro_batches=2)
    assert torch.equal(ids[2:], data.get("input_ids", 3))
    assert torch.equal(labels, ids)  # GPT-2: the labels are the inputs
