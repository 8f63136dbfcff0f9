"""--pack in the runtime: whole samples in rows, positions restarting, no label across a
boundary (a package compiled with --pack); the old stream for a package compiled without;
rows not packed and synthetic rows on a package compiled for packing."""

from __future__ import annotations

import pytest
import torch
from ftpipe_runtime.data.batches import IGNORE, TextOptions, make_data
from ftpipe_runtime.errors import PipelineConfigError
from ftpipe_runtime.models import synthetic_batch
from ftpipe_runtime.models.packing import packs_documents, positions
from text_helpers import pairs, sentences, write_jsonl, write_tokenizer

pytest.importorskip("datasets")
transformers = pytest.importorskip("transformers")

L = 16
PACKED = {
    "head": "causal-lm",
    "vocab": {"vocab_size": 32},
    "inputs": {"input_ids": [[2, L], "int64"], "position_ids": [[2, L], "int64"],
               "labels": [[2, L], "int64"]},
}  # fmt: skip
MASKED = {  # compiled without --pack
    **PACKED,
    "inputs": {"input_ids": [[2, L], "int64"], "attention_mask": [[2, L], "int64"],
               "labels": [[2, L], "int64"]},
}  # fmt: skip
QA = TextOptions(prompt_field="question", target_field="answer", pack=True)


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tok")
    write_tokenizer(folder, "llama")
    return transformers.AutoTokenizer.from_pretrained(str(folder))


def _documents(data, r: int):
    """Row r of a packed source cut into its documents: (ids, labels, positions) each."""
    ids, labels, pos = (data.row(n, r) for n in ("input_ids", "labels", "position_ids"))
    starts = [*(pos == 0).nonzero().flatten().tolist(), len(ids)]
    return [(ids[a:b], labels[a:b], pos[a:b]) for a, b in zip(starts, starts[1:])]


def test_positions_restart_per_document_and_the_padding_is_a_run_of_its_own():
    assert positions([3, 5], 10).tolist() == [0, 1, 2, 0, 1, 2, 3, 4, 0, 1]
    assert positions([1, 1, 2]).tolist() == [0, 0, 0, 1]
    assert packs_documents(PACKED) and not packs_documents(MASKED)


def test_whole_texts_in_rows_positions_restarting_no_label_across_a_boundary(tok, tmp_path):
    texts = sentences(30, seed=5)
    path = write_jsonl(tmp_path / "t.jsonl", [{"text": t} for t in texts])
    data = make_data(PACKED, str(path), 0, TextOptions(pack=True), tok)
    want = sorted(tuple(ids + [tok.eos_token_id]) for ids in tok(texts)["input_ids"])
    docs = [d for r in range(data.size) for d in _documents(data, r)]
    assert sorted(tuple(ids.tolist()) for ids, _, _ in docs) == want  # each once, whole
    for ids, labels, pos in docs:
        assert pos.tolist() == list(range(len(ids)))
        assert labels[0] == IGNORE and torch.equal(labels[1:], ids[1:])
    lengths = sorted(len(data.row("input_ids", r)) for r in range(data.size))
    assert lengths[-1] <= L
    assert lengths[0] + lengths[1] > L  # best fit: no two rows would fit in one
    batch = data.get("position_ids", 0)  # padded: each padding token a document of its own
    real = torch.tensor([len(data.row("input_ids", r)) for r in data.rows(0)])
    assert batch.masked_select(torch.arange(L) >= real[:, None]).eq(0).all()
    assert data.get("labels", 0).masked_select(torch.arange(L) >= real[:, None]).eq(IGNORE).all()


def test_prompts_stay_unlearned_when_packed(tok, tmp_path):
    rows = pairs(12, seed=6)
    path = write_jsonl(tmp_path / "qa.jsonl", rows)
    data = make_data(PACKED, str(path), 0, QA, tok)
    want = {}
    for r in rows:
        prompt = tok(r["question"])["input_ids"]
        target = tok(r["answer"], add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        want[tuple(prompt + target)] = [IGNORE] * len(prompt) + target
    docs = [d for r in range(data.size) for d in _documents(data, r)]
    assert len(docs) == len(rows)
    for ids, labels, _ in docs:
        assert labels.tolist() == want[tuple(ids.tolist())]


def test_a_text_longer_than_a_row_is_refused_or_cut(tok, tmp_path):
    long = " ".join(["one two three four five six seven eight nine ten eleven twelve"] * 2)
    path = write_jsonl(tmp_path / "t.jsonl", [{"text": "one two"}, {"text": long}])
    with pytest.raises(PipelineConfigError, match="t.jsonl sample 2 has 26 tokens of input_ids, "
                       f"more than the {L} the package was compiled for; pass --truncate"):  # fmt: skip
        make_data(PACKED, str(path), 0, TextOptions(pack=True), tok)
    said = []
    cut = TextOptions(pack=True, truncate=True)
    data = make_data(PACKED, str(path), 0, cut, tok, say=said.append)
    assert said == ["ftpipe: warning: t.jsonl: cut 1 texts to the compiled length (--truncate)"]
    assert sorted(len(data.row("input_ids", r)) for r in range(data.size)) == [4, L]


def test_a_package_compiled_without_pack_still_gets_the_stream_and_is_told(tok, tmp_path):
    texts = sentences(10, seed=4)
    path = write_jsonl(tmp_path / "t.jsonl", [{"text": t} for t in texts])
    said = []
    data = make_data(MASKED, str(path), 0, TextOptions(pack=True), tok, say=said.append)
    stream = [t for ids in tok(texts)["input_ids"] for t in ids + [tok.eos_token_id]]
    assert [t for r in range(data.size) for t in data.row("input_ids", r).tolist()] == stream
    assert said == [
        "ftpipe: note: t.jsonl: this package was compiled without --pack, so packed texts "
        "attend to each other and their positions run on; compile with `ftpipe compile --pack` "
        "to keep them apart"
    ]


def test_rows_not_packed_on_a_packed_package_are_one_document_each(tok, tmp_path):
    path = write_jsonl(tmp_path / "t.jsonl", [{"text": t} for t in sentences(4, seed=7)])
    data = make_data(PACKED, str(path), 0, tokenizer=tok)
    assert torch.equal(data.get("position_ids", 0), torch.arange(L).expand(2, L))


def test_synthetic_rows_of_a_packed_model_hold_documents():
    batch = synthetic_batch({**PACKED, "inputs": {n: [[8, L], "int64"] for n in PACKED["inputs"]}})
    pos, labels, ids = batch["position_ids"], batch["labels"], batch["input_ids"]
    assert (pos == 0).sum(1).gt(1).any()  # some rows hold several documents
    assert torch.equal(labels, ids.masked_fill(pos == 0, IGNORE))
    for row in pos:  # positions count up inside a document
        steps = row[1:] - row[:-1]
        assert ((steps == 1) | (row[1:] == 0)).all()
