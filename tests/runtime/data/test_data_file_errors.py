"""What is wrong with a data file, said of the file and line where it is: a .jsonl that shows
neither text nor token ids (blank, UTF-16, its first line broken) read as what the options say,
a broken line deep in a big file named by its line (not arrow's row in a block)."""

from __future__ import annotations

import json

import pytest
from ftpipe_runtime.data.batches import TextOptions, make_data
from ftpipe_runtime.data.text import is_text_file
from ftpipe_runtime.errors import PipelineConfigError
from text_helpers import CAUSAL, sentences, write_tokenizer

pytest.importorskip("datasets")
transformers = pytest.importorskip("transformers")

TEXT = '{"text": "one two"}\n'


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tok")
    write_tokenizer(folder, "llama")
    return transformers.AutoTokenizer.from_pretrained(str(folder))


def test_a_broken_line_deep_in_a_big_jsonl_is_named_by_its_line(tok, tmp_path):
    """Arrow parses a .jsonl in blocks and counts rows from the block's start: line 15001
    was "in row 1079", and line 6 of a small file "in row 5"."""
    lines = [json.dumps({"text": t}) for t in sentences(20000, seed=1)]
    lines[15000] = '{"text": "one two'
    path = tmp_path / "big.jsonl"
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(PipelineConfigError) as refused:
        make_data(CAUSAL, str(path), 0, TextOptions(text_field="text"), tok)
    assert str(refused.value) == (
        f"{path} line 15001 is not JSON (Unterminated string starting at column 10); give one "
        "JSON object per line"
    )


@pytest.mark.parametrize("text", [False, True])
def test_a_jsonl_that_shows_neither_kind_is_what_the_options_say(tmp_path, text):
    """Blank, UTF-16, no line of JSON, or missing: text when the text options are given (the
    text reader then says what is wrong), else token ids; a readable record decides alone."""
    files = {
        "blank.jsonl": b"\n  \n",
        "utf16.jsonl": TEXT.encode("utf-16"),
        "garbage.jsonl": b"{not json\n",
    }
    for name, data in files.items():
        (tmp_path / name).write_bytes(data)
        assert is_text_file(tmp_path / name, text=text) is text, name
    assert is_text_file(tmp_path / "missing.jsonl", text=text) is text
    (tmp_path / "t.jsonl").write_text("{broken\n" + TEXT)  # a broken first line: the next tells
    (tmp_path / "ids.jsonl").write_text("{broken\n[1, 2, 3]\n")
    (tmp_path / "named.jsonl").write_text('{"input_ids": [1, 2]}\n')
    assert is_text_file(tmp_path / "t.jsonl", text=text)
    assert not is_text_file(tmp_path / "ids.jsonl", text=text)
    assert not is_text_file(tmp_path / "named.jsonl", text=text)


@pytest.mark.parametrize(
    "data, options, message",
    [
        (b"\n \n", TextOptions(text_field="text"), "holds no samples, only blank lines"),
        (b"\n \n", TextOptions(), "holds no samples, only blank lines"),
        (b"\xef\xbb\xbf\n", TextOptions(), "holds no samples, only blank lines"),
        (b"  \n", TextOptions(chat_field="messages"), "holds no samples, only blank lines"),
        (TEXT.encode("utf-16"), TextOptions(text_field="text"), "is not UTF-8 text but UTF-16"),
        (TEXT.encode("utf-16-be"), TextOptions(), "is not UTF-8 text but UTF-16 \\(a NUL byte"),
        (b"{broken\n" + TEXT.encode(), TextOptions(chat_field="messages"), "line 1 is not JSON"),
        (b'"one two"\n' + TEXT.encode(), TextOptions(), "line 1 holds a JSON string, not an"),
    ],
)
def test_what_is_wrong_with_a_jsonl_is_said_for_training_and_evaluation(
    data, options, message, tok, tmp_path
):
    path = tmp_path / "d.jsonl"
    path.write_bytes(data)
    for evaluation in (False, True):
        with pytest.raises(PipelineConfigError, match=message) as refused:
            make_data(CAUSAL, str(path), 0, options, tok, evaluation=evaluation)
        assert "token ids" not in str(refused.value) and "non-zero" not in str(refused.value)


def test_a_missing_jsonl_is_missing_whatever_the_options(tok, tmp_path):
    for options in (TextOptions(), TextOptions(chat_field="messages"), TextOptions(pack=True)):
        with pytest.raises(PipelineConfigError, match=f"^no data file {tmp_path}/nope.jsonl$"):
            make_data(CAUSAL, str(tmp_path / "nope.jsonl"), 0, options, tok)


def test_a_csv_with_an_empty_cell_names_the_sample(tok, tmp_path):
    path = tmp_path / "d.csv"
    path.write_text("q,a\none,two\nthree,\n")
    options = TextOptions(prompt_field="q", target_field="a")
    with pytest.raises(PipelineConfigError, match="d.csv sample 2 has no value in field 'a'"):
        make_data(CAUSAL, str(path), 0, options, tok)


def test_a_chat_template_that_does_not_parse_is_blamed_not_the_sample(tok, tmp_path):
    """A Jinja syntax error was "train.jsonl line 1: the chat template fails on it"."""
    path = tmp_path / "chat.jsonl"
    talk = [{"role": "user", "content": "one"}, {"role": "assistant", "content": "two"}]
    path.write_text(json.dumps({"messages": talk}) + "\n")
    tok.chat_template = "{% for m in messages %}\n{{ m['content'] }"
    try:
        with pytest.raises(PipelineConfigError) as refused:
            make_data(CAUSAL, str(path), 0, TextOptions(chat_field="messages"), tok)
    finally:
        tok.chat_template = None
    assert str(refused.value) == (
        "the tokenizer's chat template has a syntax error on its line 2 (unexpected '}'); fix "
        "it, or pass another with --chat-template FILE"
    )
