"""Chat data (`--chat-field`): conversations rendered with a Jinja chat template, labels on the
assistant turns only, checked token by token against references built here without the
template; a BPE tokenizer trained here; truncation; the sentences bad chat data gets."""

from __future__ import annotations

import json

import pytest
import torch
from ftpipe_runtime.data.batches import IGNORE, TextOptions, make_data
from ftpipe_runtime.errors import PipelineConfigError
from text_helpers import WORDS, write_jsonl, write_tokenizer

pytest.importorskip("datasets")
transformers = pytest.importorskip("transformers")

L = 40
CAUSAL = {
    "head": "causal-lm",
    "vocab": {"vocab_size": 64},
    "inputs": {"input_ids": [[2, L], "int64"], "attention_mask": [[2, L], "int64"],
               "labels": [[2, L], "int64"]},
}  # fmt: skip
MARKS = ["<|im_start|>", "<|im_end|>", "system", "user", "assistant"]
# Words separated by spaces, so a word-level tokenizer sees each mark as one token.
WORD_TEMPLATE = (
    "{% for m in messages %}<|im_start|> {{ m['role'] }} {{ m['content'] }} <|im_end|> "
    "{% endfor %}{% if add_generation_prompt %}<|im_start|> assistant {% endif %}"
)
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CHAT = TextOptions(chat_field="messages")
TALKS = [
    [
        {"role": "system", "content": "zero one"},
        {"role": "user", "content": "two three four"},
        {"role": "assistant", "content": "five six"},
        {"role": "user", "content": "seven"},
        {"role": "assistant", "content": "eight nine ten"},
    ],
    [
        {"role": "user", "content": "one two"},
        {"role": "assistant", "content": "three"},
        {"role": "user", "content": "four five"},
        {"role": "assistant", "content": "six seven"},
    ],
]


@pytest.fixture(scope="module")
def word_tok(tmp_path_factory):
    """A word-level tokenizer (counting words and the template's marks), no chat template."""
    folder = tmp_path_factory.mktemp("tok")
    write_tokenizer(folder, "llama", words=[*WORDS, *MARKS])
    return transformers.AutoTokenizer.from_pretrained(str(folder))


def _reference(tok, messages) -> tuple[list[int], list[int]]:
    """WORD_TEMPLATE's tokens and labels built word by word, without Jinja: every message is
    <|im_start|> role content <|im_end|>; an assistant's content and its <|im_end|> are labels."""
    vocab = tok.get_vocab()
    ids, labels = [], []
    for m in messages:
        head = [vocab["<|im_start|>"], vocab[m["role"]]]
        body = [vocab[w] for w in m["content"].split()] + [vocab["<|im_end|>"]]
        ids += head + body
        labels += [IGNORE] * len(head) + (
            body if m["role"] == "assistant" else [IGNORE] * len(body)
        )
    return ids, labels


def _padded(row, pad):
    return row + [pad] * (L - len(row))


def _rows(data, name):
    return [data.row(name, r).tolist() for r in range(data.size)]


def test_labels_are_the_assistant_turns_token_by_token(word_tok, tmp_path):
    template = tmp_path / "chat.jinja"
    template.write_text(WORD_TEMPLATE)
    path = write_jsonl(tmp_path / "chat.jsonl", [{"messages": m} for m in TALKS])
    options = TextOptions(chat_field="messages", chat_template=str(template))
    data = make_data(CAUSAL, str(path), 0, options, word_tok, evaluation=True)
    for r, messages in enumerate(TALKS):  # two assistant turns in each
        ids, labels = _reference(word_tok, messages)
        assert data.row("input_ids", r).tolist() == ids
        assert data.row("labels", r).tolist() == labels
        rendered = word_tok.apply_chat_template(messages, chat_template=WORD_TEMPLATE)
        assert ids == rendered["input_ids"]  # what transformers gives the model at inference
    batch = {n: data.get(n, 0) for n in ("input_ids", "labels", "attention_mask")}
    for r, messages in enumerate(TALKS):  # padded to the compiled length, padding ignored
        ids, labels = _reference(word_tok, messages)
        assert batch["input_ids"][r].tolist() == _padded(ids, 0)
        assert batch["labels"][r].tolist() == _padded(labels, IGNORE)
        assert batch["attention_mask"][r].tolist() == _padded([1] * len(ids), 0)


def test_a_trained_bpe_tokenizer_and_its_own_template(tmp_path):
    """Byte-level BPE trained here, ChatML saved as the tokenizer's template: each run of
    labels decodes to exactly an assistant reply and its <|im_end|>."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    corpus = [f"{m['role']}\n{m['content']}" for talk in TALKS for m in talk] * 20
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<pad>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )  # fmt: skip
    bpe.train_from_iterator(corpus, trainer)
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=bpe, pad_token="<pad>", eos_token="<|im_end|>"
    )
    fast.chat_template = CHATML
    fast.save_pretrained(str(tmp_path / "bpe"))
    tok = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "bpe"))
    path = write_jsonl(tmp_path / "chat.jsonl", [{"messages": m} for m in TALKS])
    wide = {k: [[2, 64], "int64"] for k in CAUSAL["inputs"]}
    model = {**CAUSAL, "vocab": {"vocab_size": len(tok)}, "inputs": wide}
    data = make_data(model, str(path), 0, CHAT, tok, evaluation=True)
    for r, messages in enumerate(TALKS):
        ids, labels = data.row("input_ids", r).tolist(), data.row("labels", r).tolist()
        assert ids == tok.apply_chat_template(messages)["input_ids"]
        runs, run = [], []
        for i, label in zip(ids, labels):
            assert label in (i, IGNORE)  # a label is the token itself (the model shifts)
            if label == IGNORE and run:
                runs.append(tok.decode(run))
                run = []
            elif label != IGNORE:
                run.append(i)
        runs += [tok.decode(run)] if run else []
        replies = [m["content"] + "<|im_end|>" for m in messages if m["role"] == "assistant"]
        assert runs == replies


def test_truncation_keeps_labels_aligned(word_tok, tmp_path):
    template = tmp_path / "chat.jinja"
    template.write_text(WORD_TEMPLATE)
    path = write_jsonl(tmp_path / "chat.jsonl", [{"messages": m} for m in TALKS])
    cut_at = 15  # inside the first reply of TALKS[0], after the first reply of TALKS[1]
    short = {**CAUSAL, "inputs": {k: [[2, cut_at], "int64"] for k in CAUSAL["inputs"]}}
    options = TextOptions(chat_field="messages", chat_template=str(template))
    first = len(_reference(word_tok, TALKS[0])[0])
    with pytest.raises(PipelineConfigError, match=f"chat.jsonl sample 1 has {first} tokens"):
        make_data(short, str(path), 0, options, word_tok)
    said = []
    cut = TextOptions(chat_field="messages", chat_template=str(template), truncate=True)
    data = make_data(short, str(path), 0, cut, word_tok, say=said.append, evaluation=True)
    assert said == ["ftpipe: warning: chat.jsonl: cut 2 texts to the compiled length (--truncate)"]
    for r, messages in enumerate(TALKS):
        ids, labels = _reference(word_tok, messages)
        assert data.row("input_ids", r).tolist() == ids[:cut_at]
        assert data.row("labels", r).tolist() == labels[:cut_at]


def _refused(tok, tmp_path, rows, match, options=None, raw=None):
    path = tmp_path / "chat.jsonl"
    if raw is not None:
        path.write_text(raw)
    else:
        write_jsonl(path, rows)
    template = tmp_path / "chat.jinja"
    template.write_text(WORD_TEMPLATE)
    options = options or TextOptions(chat_field="messages", chat_template=str(template))
    with pytest.raises(PipelineConfigError, match=match):
        make_data(CAUSAL, str(path), 0, options, tok)


def test_bad_chat_data_is_one_sentence(word_tok, tmp_path):
    good = {"messages": TALKS[1]}
    _refused(word_tok, tmp_path, [good], "the tokenizer has no chat template to render "
             "--chat-field with; pass --chat-template FILE", options=CHAT)  # fmt: skip
    lines = [json.dumps(good), "", json.dumps({"messages": [{"role": "robot", "content": "one"}]})]
    _refused(word_tok, tmp_path, None, "chat.jsonl line 3: message 1 has the unknown role "
             "'robot'; roles are system, developer, user, assistant, tool", raw="\n".join(lines))  # fmt: skip
    _refused(word_tok, tmp_path, [good, {"messages": [{"role": "user"}]}],
             "chat.jsonl line 2: message 1 \\(user\\) has no text content")  # fmt: skip
    _refused(word_tok, tmp_path, [{"messages": "one two"}],
             "chat.jsonl line 1: the chat field holds str, not a list of \\{role, content\\}")  # fmt: skip
    _refused(word_tok, tmp_path, [good], "chat.jsonl has no field 'talk'",
             options=TextOptions(chat_field="talk"))  # fmt: skip
    _refused(word_tok, tmp_path, [good], "--chat-field is the whole sample; leave out --text-field",
             options=TextOptions(chat_field="messages", text_field="text"))  # fmt: skip
    _refused(word_tok, tmp_path, [good], "cannot read the chat template nope.jinja",
             options=TextOptions(chat_field="messages", chat_template="nope.jinja"))  # fmt: skip


def test_a_template_that_rewrites_earlier_turns_is_refused(word_tok, tmp_path):
    """Earlier turns rendered differently once more follow: no prefix holds, so the
    assistant spans are not guessed."""
    rewrites = WORD_TEMPLATE.replace(
        "{{ m['content'] }}", "{{ m['content'] }}{% if loop.last %} zero{% endif %}"
    )
    template = tmp_path / "rewrites.jinja"
    template.write_text(rewrites)
    path = write_jsonl(tmp_path / "chat.jsonl", [{"messages": TALKS[1]}])
    options = TextOptions(chat_field="messages", chat_template=str(template))
    with pytest.raises(PipelineConfigError, match="chat.jsonl line 1: the chat template renders"):
        make_data(CAUSAL, str(path), 0, options, word_tok)


def test_chat_rows_pack(word_tok, tmp_path):
    """--pack joins conversations like texts, labels alongside their tokens."""
    template = tmp_path / "chat.jinja"
    template.write_text(WORD_TEMPLATE)
    path = write_jsonl(tmp_path / "chat.jsonl", [{"messages": m} for m in TALKS])
    options = TextOptions(chat_field="messages", chat_template=str(template), pack=True)
    data = make_data(CAUSAL, str(path), 0, options, word_tok, evaluation=True)
    eos = word_tok.eos_token_id
    refs = [_reference(word_tok, m) for m in TALKS]
    ids = [t for i, _ in refs for t in [*i, eos]]
    labels = [t for _, lab in refs for t in [*lab, eos]]
    assert [t for row in _rows(data, "input_ids") for t in row] == ids
    assert [t for row in _rows(data, "labels") for t in row] == labels
    assert torch.equal(data.get("input_ids", 0)[0], torch.tensor(ids[:L]))


# documents kept apart by their positions (compiled with --pack), or one stream cut into rows
PACKED = {
    **CAUSAL,
    "inputs": {n: [[2, L], "int64"] for n in ("input_ids", "position_ids", "labels")},
}


@pytest.mark.parametrize("model", [PACKED, CAUSAL], ids=["documents", "stream"])
def test_a_conversation_without_an_assistant_turn_is_left_out_of_packs(model, word_tok, tmp_path):
    """Packed, every conversation gets an end-of-sequence label: one with no assistant turn
    taught the model to end a user's turn (the bad-input audit). It is left out, as unpacked."""
    template = tmp_path / "chat.jinja"
    template.write_text(WORD_TEMPLATE)
    lonely = [{"role": "user", "content": "twelve twelve twelve"}]
    rows = [{"messages": m} for m in [TALKS[0], lonely, TALKS[1]]]
    path = write_jsonl(tmp_path / "chat.jsonl", rows)
    options = TextOptions(chat_field="messages", chat_template=str(template), pack=True)
    said = []
    data = make_data(model, str(path), 0, options, word_tok, say=said.append, evaluation=True)
    assert said[0] == (
        f"ftpipe: note: {path}: left out 1 conversations with nothing to learn (no assistant turn)"
    )
    eos = word_tok.eos_token_id
    learnt = [t for m in TALKS for t in [*_reference(word_tok, m)[1], eos] if t != IGNORE]
    assert [t for row in _rows(data, "labels") for t in row if t != IGNORE] == learnt
    lonely_ids = _reference(word_tok, lonely)[0]
    flat = [t for row in _rows(data, "input_ids") for t in row]
    assert not any(flat[k : k + len(lonely_ids)] == lonely_ids for k in range(len(flat)))


def test_the_export_renders_chat_as_training_did(word_tok, tmp_path):
    """--chat-template FILE goes into the exported folder (chat_template.jinja), taking the
    place of a template the tokenizer's folder had."""
    from ftpipe_runtime.checkpoint.hf import copy_tokenizer

    word_tok.chat_template = "{{ messages | length }}"  # another template in the folder
    word_tok.save_pretrained(str(tmp_path / "tok"))
    word_tok.chat_template = None
    template = tmp_path / "chat.jinja"
    template.write_text(WORD_TEMPLATE)
    (tmp_path / "out").mkdir()
    copy_tokenizer(tmp_path / "tok", tmp_path / "out", chat_template=template)
    exported = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "out"))
    ids, _ = _reference(word_tok, TALKS[0])
    assert exported.apply_chat_template(TALKS[0])["input_ids"] == ids


def test_the_demos_conversations_render_with_its_template_and_its_folder_answers(tmp_path, capsys):
    """`make demo`'s chat pieces: the tokenizer's own template gives exactly the template's
    words, labels on the assistant's answer and its <|im_end|>; the folder (here untrained)
    answers through `apply_chat_template` and `generate`."""
    import demo_text

    folder = demo_text.write_model(tmp_path / "tiny", chat=True)
    tok = transformers.AutoTokenizer.from_pretrained(str(folder))
    talk = demo_text.conversations(1, seed=3)[0]["messages"]
    path = write_jsonl(tmp_path / "chat.jsonl", [{"messages": talk}])
    data = make_data(CAUSAL, str(path), 0, CHAT, tok, evaluation=True)
    ids, labels = _reference(tok, talk)
    assert data.row("input_ids", 0).tolist() == ids and data.row("labels", 0).tolist() == labels
    assert demo_text.generate(folder, questions=["one two three"]) == 0
    assert capsys.readouterr().out.startswith("user: one two three  ->  assistant: ")
