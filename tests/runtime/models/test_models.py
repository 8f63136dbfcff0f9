"""ftpipe_runtime.models: head rules, synthetic inputs, the HuggingFace side."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from ftpipe_runtime.models import (
    FAMILY_RULES,
    HEADS,
    IGNORE,
    LABELS,
    Vocab,
    decoder_inputs,
    get_head,
    input_names,
    input_shapes,
    shift_right,
    synthetic_batch,
    with_dropout,
)
from runtime_helpers import RUNTIME_HOME


def _model(head: str, names, seq=16, target=4, rows=4, **vocab) -> dict:
    shapes = input_shapes(get_head(head), names, seq, target)
    return {
        "head": head,
        "vocab": Vocab(**{"vocab_size": 50, **vocab}).to_json(),
        "inputs": {n: [[rows, *s], d] for n, (s, d) in shapes.items()},
    }


CAUSAL = _model("causal-lm", ("input_ids", "attention_mask", "labels"))
SEQ2SEQ = _model("seq2seq-lm", ("input_ids", "attention_mask", "decoder_input_ids", "labels"))


def test_every_head_draws_its_labels_and_has_a_transformers_table():
    assert set(LABELS) == set(HEADS)
    assert all(h.mapping.startswith("MODEL_FOR_") for h in HEADS.values())
    with pytest.raises(ValueError, match="unknown head 'regression'; choose from causal-lm"):
        get_head("regression")


def test_vocab_round_trip():
    v = Vocab(vocab_size=32000, type_vocab_size=2, num_labels=3, pad_token_id=1)
    assert Vocab.from_json(json.loads(json.dumps(v.to_json()))) == v
    assert Vocab.from_json({"vocab_size": 7, "pad_token_id": None}) == Vocab(vocab_size=7)


def test_input_names_follow_the_forward_and_the_head():
    forward = ["input_ids", "attention_mask", "token_type_ids", "position_ids", "labels", "kw"]
    causal = get_head("causal-lm")
    assert input_names(causal, forward, Vocab()) == ("input_ids", "attention_mask", "labels")
    assert "token_type_ids" in input_names(causal, forward, Vocab(type_vocab_size=2))
    qa = ["input_ids", "start_positions", "end_positions"]
    assert input_names(get_head("question-answering"), qa, Vocab()) == tuple(qa)
    with pytest.raises(ValueError, match="takes no labels"):
        input_names(causal, ["input_ids"], Vocab())


def test_shapes_by_head():
    names = ("input_ids", "decoder_input_ids", "labels")
    assert input_shapes(get_head("seq2seq-lm"), names, 512, 4) == {
        "input_ids": ([512], "int64"), "decoder_input_ids": ([4], "int64"),
        "labels": ([4], "int64"),
    }  # fmt: skip
    cls = input_shapes(get_head("sequence-classification"), ("input_ids", "labels"), 8)
    assert cls["labels"] == ([], "int64")
    regression = input_shapes(
        get_head("sequence-classification"), ("labels",), 8, 0, Vocab(num_labels=1)
    )
    assert regression["labels"] == ([], "float32")


def test_the_same_batch_wherever_it_is_made():
    a, b = synthetic_batch(CAUSAL, index=7, seed=3), synthetic_batch(CAUSAL, index=7, seed=3)
    assert all(torch.equal(a[n], b[n]) for n in a)
    assert not torch.equal(a["input_ids"], synthetic_batch(CAUSAL, 8, 3)["input_ids"])
    assert not torch.equal(a["input_ids"], synthetic_batch(CAUSAL, 7, 4)["input_ids"])
    # an input is drawn from its own name: the others' presence does not change it
    alone = {**CAUSAL, "inputs": {"input_ids": CAUSAL["inputs"]["input_ids"]}}
    assert torch.equal(synthetic_batch(alone, 7, 3)["input_ids"], a["input_ids"])


def test_rows_end_in_padding_that_the_labels_ignore():
    batch = synthetic_batch(CAUSAL, index=0)
    ids, mask, labels = batch["input_ids"], batch["attention_mask"], batch["labels"]
    assert ids.shape == (4, 16) and ids.dtype == torch.int64 and 0 <= ids.min() and ids.max() < 50
    assert mask.sum(1).tolist() == [16, 15, 14, 14]  # row r: min(r, 16 // 8) padding tokens
    assert torch.equal(labels, ids.masked_fill(mask == 0, IGNORE))  # causal LM: the ids


def test_seq2seq_decoder_inputs_are_the_labels_shifted():
    batch = synthetic_batch(SEQ2SEQ, index=2)
    assert batch["labels"].shape == (4, 4)
    assert torch.equal(batch["decoder_input_ids"], shift_right(batch["labels"]))
    bart = {
        **SEQ2SEQ,
        "vocab": Vocab(vocab_size=50, pad_token_id=1, decoder_start_token_id=2).to_json(),
    }
    assert (synthetic_batch(bart)["decoder_input_ids"][:, 0] == 2).all()


def test_labels_of_the_other_heads():
    qa = synthetic_batch(
        _model("question-answering", ("input_ids", "attention_mask", "start_positions", "end_positions"))
    )  # fmt: skip
    length = qa["attention_mask"].sum(1)
    assert ((qa["start_positions"] >= 0) & (qa["start_positions"] < length)).all()
    tokens = synthetic_batch(
        _model("token-classification", ("input_ids", "attention_mask", "labels"), num_labels=5)
    )
    real = tokens["attention_mask"].bool()
    assert tokens["labels"][real].max() < 5 and (tokens["labels"][~real] == IGNORE).all()
    mlm = synthetic_batch(_model("masked-lm", ("input_ids", "attention_mask", "labels")))
    picked = mlm["labels"] != IGNORE
    assert picked.any(1).all() and picked.sum() < picked.numel() / 2
    assert torch.equal(mlm["labels"][picked], mlm["input_ids"][picked])
    cls = synthetic_batch(_model("sequence-classification", ("input_ids", "labels"), num_labels=3))
    assert cls["labels"].shape == (4,) and cls["labels"].max() < 3


def test_counting_is_learnable():
    batch = synthetic_batch(SEQ2SEQ, index=4, counting=True)
    ids = batch["input_ids"]
    assert torch.equal(ids[:, 1:], (ids[:, :-1] + 1) % 50)
    assert torch.equal(batch["labels"], ids[:, :4])  # the answer copies the source's start


def test_mbart_starts_its_decoder_with_the_last_token():
    labels = torch.tensor([[5, 6, 250, IGNORE], [7, 8, 9, 251]])
    out = decoder_inputs(labels, Vocab(pad_token_id=1), "mbart")
    assert out.tolist() == [[250, 5, 6, 250], [251, 7, 8, 9]]
    assert FAMILY_RULES["mbart"]["shift"] == "wrap-last"


def test_with_dropout():
    config = {"dropout_rate": 0.1, "attn_pdrop": 0.1, "hidden_dropout_prob": 0.1, "d_model": 8}
    assert with_dropout(config, 0.0) == {
        "dropout_rate": 0.0, "attn_pdrop": 0.0, "hidden_dropout_prob": 0.0, "d_model": 8
    }  # fmt: skip


def test_the_runtime_never_imports_transformers_or_the_compiler():
    code = (
        "import sys, ftpipe_runtime, ftpipe_runtime.data.batches, ftpipe_runtime.models;"
        "ftpipe_runtime.data.batches.make_data(" + repr(CAUSAL) + ", None, 0).get('labels', 0);"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in "
        "('transformers', 'ftpipe_compiler')))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True,
        env={"PYTHONPATH": RUNTIME_HOME}, cwd="/",
    )  # fmt: skip
    assert out.stdout.strip() == "[]"


hf = pytest.importorskip("ftpipe_runtime.models.hf")


def test_heads_of_transformers_classes():
    assert hf.head_of_class("LlamaForCausalLM") == "causal-lm"
    assert hf.head_of_class("GPT2LMHeadModel") == "causal-lm"
    assert hf.head_of_class("T5ForConditionalGeneration") == "seq2seq-lm"
    assert hf.head_of_class("BertForQuestionAnswering") == "question-answering"
    assert hf.head_of_class("LlamaModel") is None
    assert hf.class_for_head("qwen2", "token-classification") == "Qwen2ForTokenClassification"
    assert hf.class_for_head("t5", "causal-lm") is None


SEQ2SEQ_CONFIGS = {
    "t5": dict(d_model=8, d_kv=4, d_ff=8, num_layers=1, num_heads=2, decoder_start_token_id=0),
    "bart": dict(d_model=8, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
                 decoder_attention_heads=2, encoder_ffn_dim=8, decoder_ffn_dim=8),
}  # fmt: skip
SEQ2SEQ_CONFIGS.update({t: SEQ2SEQ_CONFIGS["bart"] for t in ("mbart", "plbart", "pegasus")})


@pytest.mark.parametrize("model_type", SEQ2SEQ_CONFIGS)
def test_decoder_inputs_are_the_models_own_shift(model_type, monkeypatch):
    config = {"model_type": model_type, "vocab_size": 300, **SEQ2SEQ_CONFIGS[model_type]}
    net = hf.build_model(config, hf.class_for_head(model_type, "seq2seq-lm"), "meta")
    vocab = hf.vocab_of(net.config)
    assert hf.shift_agrees(net, vocab, model_type)
    if model_type in FAMILY_RULES:  # the rule is needed: without it the shifts disagree
        monkeypatch.delitem(FAMILY_RULES, model_type)
        assert not hf.shift_agrees(net, vocab, model_type)
