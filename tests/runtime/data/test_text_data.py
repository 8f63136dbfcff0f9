"""Text data: every format read with `datasets`, tokenized by the model's own tokenizer, fields,
loss on the target only, padding and packing, over-long texts, and the evaluation set."""

from __future__ import annotations

import json

import pytest
import torch
from ftpipe_runtime.data.batches import IGNORE, TextOptions, make_data
from ftpipe_runtime.errors import PipelineConfigError
from text_helpers import CAUSAL, L, pairs, sentences, write_jsonl, write_tokenizer

pytest.importorskip("datasets")
transformers = pytest.importorskip("transformers")

SEQ2SEQ = {
    "head": "seq2seq-lm",
    "model_type": "t5",
    "vocab": {"vocab_size": 32, "decoder_start_token_id": 0},
    "inputs": {"input_ids": [[2, L], "int64"], "attention_mask": [[2, L], "int64"],
               "decoder_input_ids": [[2, 4], "int64"], "labels": [[2, 4], "int64"]},
}  # fmt: skip
QA = TextOptions(prompt_field="question", target_field="answer")


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tok")
    write_tokenizer(folder, "llama")
    return transformers.AutoTokenizer.from_pretrained(str(folder))


def _all(data, name, n):
    return torch.cat([data.get(name, mb) for mb in range(n)])


def _rows(data, name, n):
    return sorted(map(tuple, _all(data, name, n).tolist()))


@pytest.mark.parametrize("fmt", ["jsonl", "json", "csv", "parquet", "txt"])
def test_every_format_gives_the_same_tokens(fmt, tok, tmp_path):
    texts = sentences(6, seed=1)
    path = tmp_path / f"train.{fmt}"
    if fmt == "jsonl":
        write_jsonl(path, [{"text": t} for t in texts])
    elif fmt == "json":
        path.write_text(json.dumps([{"text": t} for t in texts]))
    elif fmt == "csv":
        path.write_text("text\n" + "".join(f"{t}\n" for t in texts))
    elif fmt == "parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.table({"text": texts}), path)
    else:
        path.write_text("".join(f"{t}\n" for t in texts))
    data = make_data(CAUSAL, str(path), 0, tokenizer=tok)
    want = sorted(
        tuple(ids + [0] * (L - len(ids))) for ids in tok(texts)["input_ids"]
    )  # <s> then the words, padded
    assert _rows(data, "input_ids", 3) == want
    mask, ids, labels = (_all(data, n, 3) for n in ("attention_mask", "input_ids", "labels"))
    assert torch.equal(mask, (torch.arange(L) < mask.sum(1, keepdim=True)).long())
    assert torch.equal(labels, ids.masked_fill(mask == 0, IGNORE))  # the model shifts them


def test_prompt_and_target_put_the_loss_on_the_target_only(tok, tmp_path):
    rows = pairs(4, seed=2)
    path = write_jsonl(tmp_path / "qa.jsonl", rows)
    data = make_data(CAUSAL, str(path), 0, QA, tok)
    ids, labels = _all(data, "input_ids", 2), _all(data, "labels", 2)
    for r in rows:
        prompt = tok(r["question"])["input_ids"]
        target = tok(r["answer"], add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        i = ids.tolist().index(prompt + target + [0] * (L - len(prompt) - len(target)))
        assert labels[i].tolist() == [IGNORE] * len(prompt) + target + [IGNORE] * (
            L - len(prompt) - len(target)
        )


def test_seq2seq_sources_in_targets_as_labels(tok, tmp_path):
    rows = pairs(4, seed=3)
    path = write_jsonl(tmp_path / "qa.jsonl", rows)
    data = make_data(SEQ2SEQ, str(path), 0, QA, tok)
    labels, dec = _all(data, "labels", 2), _all(data, "decoder_input_ids", 2)
    targets = sorted(tuple(tok(r["answer"])["input_ids"]) for r in rows)  # <s> w w: 3 of 4
    assert sorted(tuple(x for x in row if x != IGNORE) for row in labels.tolist()) == targets
    assert dec[:, 0].eq(0).all() and torch.equal(dec[:, 1:3], labels[:, :2])
    with pytest.raises(PipelineConfigError, match="pass --prompt-field and --target-field"):
        make_data(SEQ2SEQ, str(path), 0, TextOptions(text_field="question"), tok)


def test_packing_fills_every_row(tok, tmp_path):
    texts = sentences(10, seed=4)
    path = write_jsonl(tmp_path / "t.jsonl", [{"text": t} for t in texts])
    data = make_data(CAUSAL, str(path), 0, TextOptions(pack=True), tok)
    stream = [t for ids in tok(texts)["input_ids"] for t in ids + [tok.eos_token_id]]
    assert data.size == -(-len(stream) // L)
    rows = [data.row("input_ids", r).tolist() for r in range(data.size)]
    assert [t for row in rows for t in row] == stream and all(len(r) == L for r in rows[:-1])
    with pytest.raises(PipelineConfigError, match="--pack joins texts for a causal LM"):
        make_data(SEQ2SEQ, str(path), 0, TextOptions(pack=True, **QA.to_json()), tok)


def test_a_text_longer_than_the_compiled_length_is_refused_or_cut(tok, tmp_path):
    long = " ".join(["one two three four five six seven eight nine ten eleven twelve"] * 2)
    path = write_jsonl(tmp_path / "t.jsonl", [{"text": "one two"}, {"text": long}])
    with pytest.raises(PipelineConfigError, match="t.jsonl sample 2 has 25 tokens of input_ids, "
                       f"more than the {L} the package was compiled for; pass --truncate"):  # fmt: skip
        make_data(CAUSAL, str(path), 0, tokenizer=tok)
    said = []
    data = make_data(CAUSAL, str(path), 0, TextOptions(truncate=True), tok, say=said.append)
    assert said == ["ftpipe: warning: t.jsonl: cut 1 texts to the compiled length (--truncate)"]
    assert max(len(data.row("input_ids", r)) for r in range(2)) == L


def test_an_over_long_target_names_the_target_length_even_when_it_equals_the_input_length(
    tok, tmp_path
):
    same = {**SEQ2SEQ, "inputs": {k: [[2, 4], "int64"] for k in SEQ2SEQ["inputs"]}}
    rows = [{"question": "one", "answer": "one two three four five six"}]
    path = write_jsonl(tmp_path / "t.jsonl", rows)
    with pytest.raises(PipelineConfigError, match="tokens of labels, .* a longer --target-len"):
        make_data(same, str(path), 0, QA, tok)


def test_an_evaluation_set_is_read_once_in_order(tok, tmp_path):
    rows = pairs(5, seed=5)
    path = write_jsonl(tmp_path / "val.jsonl", rows)
    data = make_data(CAUSAL, str(path), 0, QA, tok, evaluation=True)
    assert data.micro_batches == 3 and [data.weight(mb) for mb in range(3)] == [2, 2, 1]
    ids = _all(data, "input_ids", 3)
    firsts = [tok(r["question"])["input_ids"][1] for r in rows]
    assert ids[:5, 1].tolist() == firsts  # file order
    assert ids[5].eq(0).all() and _all(data, "labels", 3)[5].eq(IGNORE).all()  # filler row
    assert _all(data, "attention_mask", 3)[5].eq(0).all()
    train = make_data(CAUSAL, str(path), 0, QA, tok)
    assert _all(train, "input_ids", 3)[:5, 1].tolist() != firsts  # training shuffles


def test_token_id_files_keep_working_and_refuse_text_options(tmp_path):
    path = write_jsonl(tmp_path / "ids.jsonl", [{"input_ids": [1, 2, 3]}, {"input_ids": [4, 5]}])
    data = make_data(CAUSAL, str(path), 0)  # no tokenizer needed
    assert sorted(data.row("input_ids", r).tolist()[0] for r in range(2)) == [1, 4]
    with pytest.raises(PipelineConfigError, match="holds token ids; the text options are for text"):
        make_data(CAUSAL, str(path), 0, TextOptions(text_field="text"))


def test_text_needs_a_language_model_and_a_tokenizer(tok, tmp_path):
    path = write_jsonl(tmp_path / "t.jsonl", [{"text": "one two"}])
    classifier = {**CAUSAL, "head": "sequence-classification"}
    with pytest.raises(PipelineConfigError, match="text data is for causal-lm and seq2seq-lm"):
        make_data(classifier, str(path), 0, tokenizer=tok)
    with pytest.raises(
        PipelineConfigError, match="the plan names no model folder; pass --tokenizer"
    ):
        make_data(CAUSAL, str(path), 0)
    with pytest.raises(PipelineConfigError, match="has no tokenizer files; pass --tokenizer"):
        make_data(CAUSAL, str(path), 0, tokenizer=str(tmp_path))
