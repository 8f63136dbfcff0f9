"""Data sources, optimizers, the learning-rate schedule and clipping."""

from __future__ import annotations

import json

import pytest
import torch
from ftpipe_runtime.data.batches import IGNORE, make_data, shift_right
from ftpipe_runtime.errors import PipelineConfigError
from ftpipe_runtime.train.optim import OPTIMIZERS, clip_coef, lr_at, make_optimizer, squared_norm

GPT2 = {
    "head": "causal-lm",
    "vocab": {"vocab_size": 50},
    "inputs": {"input_ids": [[2, 5], "int64"], "labels": [[2, 5], "int64"]},
}
T5 = {
    "head": "seq2seq-lm",
    "vocab": {"vocab_size": 50},
    "inputs": {
        "input_ids": [[2, 6], "int64"],
        "attention_mask": [[2, 6], "int64"],
        "decoder_input_ids": [[2, 3], "int64"],
        "labels": [[2, 3], "int64"],
    },
}


def test_synthetic_data_is_the_same_on_every_rank_whatever_it_reads():
    a, b = make_data(T5, None, seed=3), make_data(T5, None, seed=3)
    b.get("labels", 7)  # another rank reads something else first
    assert torch.equal(a.get("input_ids", 7), b.get("input_ids", 7))
    assert not torch.equal(a.get("input_ids", 7), a.get("input_ids", 8))
    assert not torch.equal(a.get("input_ids", 7), make_data(T5, None, 4).get("input_ids", 7))
    assert a.get("attention_mask", 0).eq(1).all()
    ids = a.get("input_ids", 1)
    assert ids.shape == (2, 6) and ids.dtype == torch.int64 and 0 <= ids.min() <= ids.max() < 50
    gpt2 = make_data(GPT2, None, 0)
    assert torch.equal(gpt2.get("labels", 2), gpt2.get("input_ids", 2))


def test_copy_task_is_a_function_of_the_inputs():
    d = make_data(T5, "copy", 0)
    ids = d.get("input_ids", 4)
    assert torch.equal(ids[:, 1:], (ids[:, :-1] + 1) % 50)  # counting sequences
    assert torch.equal(d.get("labels", 4), ids[:, :3])
    assert torch.equal(d.get("decoder_input_ids", 4), shift_right(ids[:, :3]))


def test_jsonl_file_rows_are_padded_and_derived(tmp_path):
    path = tmp_path / "train.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in ([1, 2, 3], [4, 5, 6, 7, 8, 9], [7, 8])))
    d = make_data(GPT2, str(path), seed=0)
    seen = torch.cat([d.get("input_ids", mb) for mb in range(3)])  # 6 rows: two epochs
    assert sorted(map(tuple, seen[:3].tolist())) == sorted(map(tuple, seen[3:].tolist()))
    row = next(r for r in seen.tolist() if r[0] == 1)
    assert row == [1, 2, 3, 0, 0]
    labels = torch.cat([d.get("labels", mb) for mb in range(3)])
    assert labels.tolist()[seen.tolist().index(row)] == [1, 2, 3, IGNORE, IGNORE]


def test_pt_file_of_a_dict_and_a_missing_input(tmp_path):
    path = tmp_path / "train.pt"
    ids = torch.arange(24).reshape(4, 6)
    torch.save({"input_ids": ids, "labels": ids[:, :3]}, path)
    d = make_data(T5, str(path), 0)
    assert d.get("attention_mask", 0).eq(1).all()
    torch.save({"input_ids": ids}, path)
    with pytest.raises(PipelineConfigError, match="has no 'labels'"):  # when opened, not later
        make_data(T5, str(path), 0)
    with pytest.raises(PipelineConfigError, match="unknown data"):
        make_data(T5, "nonsense", 0)


def test_learning_rate_warms_up_then_decays():
    lrs = [lr_at(k, 1.0, steps=6, warmup=2) for k in range(6)]
    assert lrs == pytest.approx([0.0, 0.5, 1.0, 0.75, 0.5, 0.25])  # the Trainer's: k / warmup
    assert lr_at(3, 0.1, 6, decay="constant") == 0.1


def test_clip_coefficient_is_torchs():
    grads = [torch.randn(3, 4, generator=torch.Generator().manual_seed(i)) for i in range(3)]
    params = [torch.nn.Parameter(torch.zeros_like(g)) for g in grads]
    for p, g in zip(params, grads):
        p.grad = g.clone()
    torch.nn.utils.clip_grad_norm_(params, 0.7)
    coef = clip_coef(squared_norm(grads), 0.7)
    for p, g in zip(params, grads):
        torch.testing.assert_close(p.grad, g * coef)


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_every_optimizer_steps(name):
    p = torch.nn.Parameter(torch.ones(4, 4))
    opt = make_optimizer(name, [p], 0.1)
    p.grad = torch.ones(4, 4)
    opt.step()
    assert p.detach().lt(1).all()


def test_optimizer_registry_errors():
    with pytest.raises(PipelineConfigError, match="unknown optimizer 'lamb'; choose from"):
        make_optimizer("lamb", [], 0.1)
    assert make_optimizer("adamw", [torch.nn.Parameter(torch.ones(1), False)], 0.1) is None


def test_samples_with_nothing_to_predict_are_left_out(tmp_path, capsys):
    """One token per sample gives a causal LM no target: a micro-batch of such samples has a
    loss of 0/0 = NaN. They are dropped with a warning; a file of nothing else is refused."""
    path = tmp_path / "one-token.pt"
    torch.save(torch.arange(8).reshape(8, 1), path)
    with pytest.raises(PipelineConfigError, match="no sample has a token to predict"):
        make_data(GPT2, str(path), 0)
    rows = [torch.tensor([1]), torch.tensor([2, 3]), torch.tensor([4]), torch.tensor([5, 6])]
    torch.save({"input_ids": rows}, path)
    d = make_data(GPT2, str(path), 0)
    assert "left out 2 samples with nothing to predict" in capsys.readouterr().err
    rows = torch.cat([d.get("input_ids", mb) for mb in range(2)])[:, :2].tolist()
    assert sorted(rows) == [[2, 3], [2, 3], [5, 6], [5, 6]]
    labels = d.get("labels", 0)
    assert (labels != IGNORE).sum(dim=1).min() >= 2  # every sample has a target


def test_epochs_set_the_steps_and_the_shuffle_seed_the_order(tmp_path, monkeypatch):
    """--epochs E: steps to cover the file E times (toy: 4 micro-batches of 2 per step);
    --shuffle-seed changes the order, not the samples."""
    from ftpipe_runtime import run
    from runtime_toy import STAGES, one_rank_plan

    monkeypatch.chdir(tmp_path)
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps([1 + i % 5, 2, 3, 4]) + "\n" for i in range(12)))
    summary = run(one_rank_plan(), STAGES, ["--data", str(path), "--epochs", "2"])
    assert summary["steps"] == 3  # ceil(2 * 12 / 8)
    model = one_rank_plan()["model"]
    a, b = make_data(model, str(path), 1), make_data(model, str(path), 2)
    first_epoch = [r for mb in range(6) for r in a.rows(mb)]  # 6 micro-batches of 2
    assert sorted(first_epoch) == list(range(12))
    assert first_epoch != [r for mb in range(6) for r in b.rows(mb)]


@pytest.mark.parametrize("name", ["adam", "adamw"])
def test_adam_uses_the_fused_kernel_and_steps_as_the_loop_does(name):
    """Same update rule as torch's default loop (within float rounding), one fused pass."""
    torch.manual_seed(0)
    start, grads = torch.randn(64, 32), [torch.randn(64, 32) for _ in range(3)]
    fused, loop = torch.nn.Parameter(start.clone()), torch.nn.Parameter(start.clone())
    opt = make_optimizer(name, [fused], 1e-2)
    ref = {"adam": torch.optim.Adam, "adamw": torch.optim.AdamW}[name](
        [loop],
        lr=1e-2,
        weight_decay=0.0,  # the Trainer's default, not torch's AdamW 0.01
    )
    assert opt.defaults["fused"] and not ref.defaults["fused"]
    for g in grads:
        fused.grad, loop.grad = g.clone(), g.clone()
        opt.step()
        ref.step()
    torch.testing.assert_close(fused.detach(), loop.detach(), rtol=1e-6, atol=1e-7)
