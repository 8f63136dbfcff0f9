"""Shapes from the data (`ftpipe compile --data`): the plan's lengths are the percentile of the
data's token lengths, computed here independently (numpy's inverted-CDF percentile of the
tokenizer's own counts); an explicit length wins; what is cut and padded is reported."""

from __future__ import annotations

import json
import random
import re
import shutil

import numpy as np
import pytest
from ftpipe_runtime.data.text import TextOptions
from text_helpers import sentences, write_jsonl, write_model

from ftpipe_compiler.errors import FtpipeError
from ftpipe_compiler.model.data_shapes import data_shapes, length_at
from ftpipe_compiler.model.zoo import resolve_model

transformers = pytest.importorskip("transformers")
pytest.importorskip("datasets")
from click.testing import CliRunner  # noqa: E402

from ftpipe_compiler.cli import cli  # noqa: E402

CHAT_TEMPLATE = "{% for m in messages %}<s> {{ m['content'] }} </s> {% endfor %}"
CHAT_LINE = json.dumps({"messages": [{"role": "user", "content": "one"},
                                     {"role": "assistant", "content": "two"}]})  # fmt: skip


def _expected(lengths, percentile) -> int:
    """The reference: numpy's nearest-rank percentile, rounded up to a multiple of 8."""
    at = int(np.percentile(lengths, percentile, method="inverted_cdf"))
    return -(-at // 8) * 8


@pytest.mark.parametrize("percentile", [50, 90, 95, 99, 100])
def test_length_at_is_the_nearest_rank_percentile_rounded_up_to_8(percentile):
    rng = random.Random(percentile)
    for n in (1, 7, 100, 2001):
        lengths = [rng.randint(1, 500) for _ in range(n)]
        assert length_at(lengths, percentile) == _expected(lengths, percentile)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("shapes")
    texts = sentences(300, seed=0, low=1, high=40)
    write_jsonl(root / "train.jsonl", [{"text": t} for t in texts])
    questions, answers = sentences(100, seed=1, low=4, high=30), sentences(100, seed=2, high=20)
    write_jsonl(
        root / "qa.jsonl", [{"question": q, "answer": a} for q, a in zip(questions, answers)]
    )
    talks = [[{"role": "user", "content": q}, {"role": "assistant", "content": a}]
             for q, a in zip(questions, answers)]  # fmt: skip
    write_jsonl(root / "chat.jsonl", [{"messages": t} for t in talks])
    (root / "chat.jinja").write_text(CHAT_TEMPLATE)
    return {
        "root": root,
        "texts": texts,
        "qa": (questions, answers),
        "talks": talks,
        "llama": write_model(root / "llama", "llama"),
        "t5": write_model(root / "t5", "t5"),
    }


def _token_lengths(folder, texts):
    tok = transformers.AutoTokenizer.from_pretrained(str(folder))
    return [len(ids) for ids in tok(texts)["input_ids"]]


def _compile(folder, out, *extra):
    args = ["compile", "--model", str(folder), "--gpus", "2", "--micro-batch", "2", "--batch",
            "4", "-o", str(out), "--partitioners", "even-layers", "--schedule", "gpipe", *extra]  # fmt: skip
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 0, result.output
    plan = json.loads((out / "plan.json").read_text())
    return result.output, {k: v[0] for k, v in plan["model"]["inputs"].items()}


def test_compile_sets_the_sequence_length_from_the_data(folders):
    root = folders["root"]
    lengths = _token_lengths(folders["llama"], folders["texts"])
    want = _expected(lengths, 99)
    output, shapes = _compile(folders["llama"], root / "out", "--data", str(root / "train.jsonl"))
    assert shapes["input_ids"] == [2, want]
    cut = sum(n > want for n in lengths)
    waste = 1 - sum(min(n, want) for n in lengths) / (want * len(lengths))
    said = [line for line in output.splitlines() if line.startswith("data ")]  # (phase lines)
    assert said[0] == (
        f"data train.jsonl: --seq-len {want} (percentile 99, rounded up to 8; longest "
        f"{max(lengths)}): {cut} of {len(lengths)} samples longer, padding {waste:.1%} of the tokens"
    )


def test_seq2seq_sources_and_targets_at_another_percentile(folders):
    root = folders["root"]
    questions, answers = folders["qa"]
    sources = _token_lengths(folders["t5"], questions)
    targets = _token_lengths(folders["t5"], answers)
    data = ["--data", str(root / "qa.jsonl"), "--prompt-field", "question", "--target-field",
            "answer", "--len-percentile", "90"]  # fmt: skip
    _, shapes = _compile(folders["t5"], root / "t5out", *data)
    assert shapes["input_ids"] == [2, _expected(sources, 90)]
    assert shapes["labels"] == [2, _expected(targets, 90)]


def test_an_explicit_length_wins_and_is_measured(folders):
    spec = resolve_model(str(folders["llama"]))
    lengths = _token_lengths(folders["llama"], folders["texts"])
    data = folders["root"] / "train.jsonl"
    shapes = data_shapes(spec, data, TextOptions(), seq_len=16)
    assert shapes.seq_len is None  # nothing to change: the user's 16 stays
    assert shapes.seq.length == 16 and shapes.seq.cut == sum(n > 16 for n in lengths)
    assert "--seq-len 16 (given; longest" in shapes.line()
    packed = data_shapes(spec, data, TextOptions(pack=True))
    assert packed.seq_len is None and packed.tokens == sum(lengths)
    assert "--pack puts whole samples into full rows" in packed.line()
    # Packed rows take whole samples: those longer than a row are counted (the run refuses
    # them unless --truncate cuts them).
    row = sorted(lengths)[len(lengths) // 2]
    packed = data_shapes(spec, data, TextOptions(pack=True), seq_len=row)
    longer = sum(n > row for n in lengths)
    assert packed.too_long == longer > 0 and packed.seq_len is None
    assert f"{longer} of {len(lengths)} samples are longer than a row of {row} tokens" in (
        packed.line()
    )
    fits = data_shapes(spec, data, TextOptions(pack=True), seq_len=max(lengths))
    assert fits.too_long == 0 and f"every sample fits a row of {max(lengths)}" in fits.line()
    few = data_shapes(spec, data, TextOptions(), samples=50)
    assert few.samples == 50


def test_data_options_need_data_and_a_model_folder(folders, tmp_path):
    result = CliRunner().invoke(cli, ["compile", "--model", "gpt2", "--gpus", "2",
                                      "--text-field", "body"])  # fmt: skip
    assert result.exit_code == 2 and "--text-field says how to read --data FILE; pass --data" in (
        result.output
    )
    with pytest.raises(FtpipeError, match="gpt2 has no model folder"):
        data_shapes(resolve_model("gpt2"), folders["root"] / "train.jsonl", TextOptions())
    with pytest.raises(FtpipeError, match="no data file"):
        data_shapes(resolve_model(str(folders["llama"])), tmp_path / "nope.jsonl", TextOptions())
    out = tmp_path / "out"
    result = CliRunner().invoke(cli, ["compile", "--model", str(folders["llama"]), "--gpus", "2",
                                      "--data", str(tmp_path / "nope.jsonl"), "-o", str(out)])  # fmt: skip
    assert result.exit_code == 1 and "no data file" in result.output and not out.exists()


def test_chat_data_is_measured_as_rendered(folders):
    spec = resolve_model(str(folders["llama"]))
    tok = transformers.AutoTokenizer.from_pretrained(str(folders["llama"]))
    lengths = [len(tok.apply_chat_template(t, chat_template=CHAT_TEMPLATE)["input_ids"])
               for t in folders["talks"]]  # fmt: skip
    chat = TextOptions(chat_field="messages", chat_template=str(folders["root"] / "chat.jinja"))
    shapes = data_shapes(spec, folders["root"] / "chat.jsonl", chat, percentile=95)
    assert shapes.seq_len == _expected(lengths, 95) and shapes.seq.longest == max(lengths)


def test_a_file_of_token_ids_is_measured_as_it_is(folders, tmp_path):
    rng = random.Random(3)
    rows = [[1] * rng.randint(2, 60) for _ in range(500)]
    path = write_jsonl(tmp_path / "ids.jsonl", [{"input_ids": r} for r in rows])
    spec = resolve_model(str(folders["llama"]))
    shapes = data_shapes(spec, path, TextOptions(), percentile=95)
    assert shapes.seq_len == _expected([len(r) for r in rows], 95) and shapes.samples == 500
    with pytest.raises(FtpipeError, match="holds token ids; the text options are for text"):
        data_shapes(spec, path, TextOptions(text_field="text"))


def test_the_model_s_positions_cap_the_length_and_the_line_says_so(folders, tmp_path):
    config = json.loads((folders["llama"] / "config.json").read_text())
    positions = config["max_position_embeddings"]
    texts = sentences(50, seed=6, low=positions + 10, high=positions + 40)
    path = write_jsonl(tmp_path / "long.jsonl", [{"text": t} for t in texts])
    shapes = data_shapes(resolve_model(str(folders["llama"])), path, TextOptions())
    lengths = _token_lengths(folders["llama"], texts)
    assert shapes.seq_len == positions and shapes.seq.cut == 50
    assert (
        f"--seq-len {positions} (percentile 99 is {_expected(lengths, 99)}, more than the "
        f"model's positions; longest {max(lengths)}): 50 of 50 samples longer"
    ) in shapes.line()


@pytest.mark.parametrize(
    "data, message",
    [
        (b"", "d.jsonl is empty; give one sample per line or row"),
        (b"\n  \n", "d.jsonl holds no samples, only blank lines"),
        ((CHAT_LINE + "\n").encode("utf-16"), "d.jsonl is not UTF-8 text but UTF-16"),
        (b"{broken\n" + CHAT_LINE.encode(), "d.jsonl line 1 is not JSON \\(Expecting property"),
    ],
)
def test_a_data_file_that_shows_neither_text_nor_token_ids_is_named_for_what_it_is(
    folders, tmp_path, data, message
):
    """A blank, UTF-16 or broken .jsonl with the text options was "holds token ids; the text
    options are for text" (and a blank one without them, "every column needs the same...")."""
    path = tmp_path / "d.jsonl"
    path.write_bytes(data)
    spec = resolve_model(str(folders["llama"]))
    for options in (TextOptions(chat_field="messages"), TextOptions()):
        with pytest.raises(FtpipeError, match=message) as refused:
            data_shapes(spec, path, options)
        assert "token ids" not in str(refused.value) and "non-zero" not in str(refused.value)
    out = tmp_path / "out"
    result = CliRunner().invoke(cli, ["compile", "--model", str(folders["llama"]), "--gpus", "2",
                                      "--data", str(path), "--chat-field", "messages",
                                      "-o", str(out)])  # fmt: skip
    assert result.exit_code == 1 and re.search(message, result.output), result.output
    assert not out.exists()


def test_a_model_folder_without_a_tokenizer_is_told_what_compile_can_do(folders, tmp_path):
    """compile has no --tokenizer: the sentence said "pass --tokenizer FOLDER" all the same."""
    bare = tmp_path / "bare"
    bare.mkdir()
    for f in folders["llama"].iterdir():
        if f.name in ("config.json", "model.safetensors"):
            shutil.copy(f, bare / f.name)
    with pytest.raises(FtpipeError) as refused:
        data_shapes(resolve_model(str(bare)), folders["root"] / "chat.jsonl",
                    TextOptions(chat_field="messages"))  # fmt: skip
    assert str(refused.value) == (
        f"--data measures text with the model's tokenizer, and the model folder {bare} has no "
        "tokenizer files; save the tokenizer into it (tokenizer.save_pretrained), or compile "
        "without --data (choosing --seq-len) and run the package with --tokenizer FOLDER"
    )


def test_a_broken_line_is_named_by_its_line_when_measuring(folders, tmp_path):
    lines = [json.dumps({"text": t}) for t in sentences(20000, seed=4)]
    lines[15000] = '{"text": "one" "two"}'
    path = tmp_path / "big.jsonl"
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(FtpipeError, match="big.jsonl line 15001 is not JSON \\(Expecting ','"):
        data_shapes(resolve_model(str(folders["llama"])), path, TextOptions())
