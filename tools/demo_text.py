#!/usr/bin/env python
"""Text to fine-tune on, with nothing downloaded: a tiny Llama folder with its own tokenizer
and chat template, and conversations (`make demo`; the tests build their models from the
same pieces).

    python tools/demo_text.py out/demo-text
    # out/demo-text/{tiny-llama/ (config, weights, tokenizer + chat template), train.jsonl,
    #                val.jsonl}: {"messages": [{"role": "user", ...}, {"role": "assistant", ...}]}
    python tools/demo_text.py --generate out/demo-text/fine-tuned
    # the exported folder answers, through transformers and its chat template

The tokenizer is a word-level one built with `tokenizers` and saved as a
`PreTrainedTokenizerFast`, so `AutoTokenizer` loads it as it loads any model's: "llama" style
starts every text with <s>, "t5" style ends it with </s>. A question is a run of counting
words ("four five six"); its answer, the two words that follow: learnable in a few steps.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

WORDS = ("zero one two three four five six seven eight nine ten eleven twelve").split()
SPECIAL = ["<pad>", "<unk>", "<s>", "</s>"]  # ids 0..3
MARKS = ["<|im_start|>", "<|im_end|>", "user", "assistant"]  # the chat template's words
# ChatML with the marks as words of their own (a word-level tokenizer splits on spaces).
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|> {{ m['role'] }} {{ m['content'] }} <|im_end|> "
    "{% endfor %}{% if add_generation_prompt %}<|im_start|> assistant {% endif %}"
)


def sentences(n: int, seed: int = 0, low: int = 3, high: int = 8) -> list[str]:
    """Counting runs ("four five six seven")."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        start, length = rng.randrange(len(WORDS)), rng.randint(low, high)
        out.append(" ".join(WORDS[(start + i) % len(WORDS)] for i in range(length)))
    return out


def pairs(n: int, seed: int = 0) -> list[dict]:
    """{"question": a counting run, "answer": the two words that follow it}."""
    rows = []
    for text in sentences(n, seed, 3, 6):
        nxt = WORDS.index(text.split()[-1]) + 1
        answer = " ".join(WORDS[(nxt + i) % len(WORDS)] for i in range(2))
        rows.append({"question": text, "answer": answer})
    return rows


def conversations(n: int, seed: int = 0) -> list[dict]:
    """{"messages": [the user's counting run, the assistant's two words that follow it]}."""
    return [
        {"messages": [{"role": "user", "content": p["question"]},
                      {"role": "assistant", "content": p["answer"]}]}
        for p in pairs(n, seed)
    ]  # fmt: skip


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def write_tokenizer(folder: Path, style: str = "llama", words=WORDS, chat_template=None):
    """A word-level tokenizer of `words` in `folder`, loadable with AutoTokenizer (with
    `chat_template`, what `apply_chat_template` renders)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate([*SPECIAL, *words])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    bos, eos = vocab["<s>"], vocab["</s>"]
    if style == "llama":
        tok.post_processor = processors.TemplateProcessing(
            single="<s> $A", pair="<s> $A $B", special_tokens=[("<s>", bos)]
        )
    else:
        tok.post_processor = processors.TemplateProcessing(
            single="$A </s>", pair="$A </s> $B </s>", special_tokens=[("</s>", eos)]
        )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="<pad>",
        unk_token="<unk>",
        bos_token="<s>",
        eos_token="</s>",
    )
    if chat_template is not None:
        fast.chat_template = chat_template
    folder.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(str(folder))
    return fast


def tiny_config(family: str):
    """A tiny Llama (tied embeddings) or T5 config over the tokenizer's 32-id vocabulary."""
    import transformers

    if family == "llama":
        return transformers.LlamaConfig(
            hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=32, max_position_embeddings=64,
            tie_word_embeddings=True, attention_dropout=0.0, bos_token_id=2, eos_token_id=3,
            pad_token_id=0, architectures=["LlamaForCausalLM"],
        )  # fmt: skip
    return transformers.T5Config(
        d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4, vocab_size=32,
        decoder_start_token_id=0, dropout_rate=0.0, eos_token_id=3, pad_token_id=0,
        architectures=["T5ForConditionalGeneration"],
    )  # fmt: skip


def write_model(folder: Path, family: str = "llama", seed: int = 0, chat: bool = False) -> Path:
    """A randomly initialised tiny model, saved with its tokenizer (`save_pretrained`; with
    `chat`, the chat template's words and the template)."""
    import torch
    import transformers

    transformers.utils.logging.disable_progress_bar()
    config = tiny_config(family)
    torch.manual_seed(seed)
    getattr(transformers, config.architectures[0])(config).save_pretrained(folder)
    style = "llama" if family == "llama" else "t5"
    if chat:
        write_tokenizer(folder, style, words=[*WORDS, *MARKS], chat_template=CHAT_TEMPLATE)
    else:
        write_tokenizer(folder, style)
    return folder


def generate(folder: Path, questions=("three four five", "eight nine ten eleven")) -> int:
    """What the fine-tuned folder answers, through transformers and its chat template."""
    import torch
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(str(folder))
    model = transformers.AutoModelForCausalLM.from_pretrained(str(folder)).eval()
    for q in questions:
        ids = tok.apply_chat_template([{"role": "user", "content": q}],
                                      add_generation_prompt=True, return_tensors="pt")  # fmt: skip
        if not isinstance(ids, torch.Tensor):  # a BatchEncoding in some versions
            ids = ids["input_ids"]
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=3, do_sample=False,
                                 pad_token_id=tok.pad_token_id)  # fmt: skip
        answer = tok.decode(out[0, ids.shape[1] :], skip_special_tokens=False)
        print(f"user: {q}  ->  assistant: {answer}")
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path, help="the folder to write (with --generate: to read)")
    ap.add_argument("--generate", action="store_true",
                    help="OUT is a fine-tuned folder: print what it answers")  # fmt: skip
    ap.add_argument("--pairs", action="store_true",
                    help="question/answer pairs instead of conversations, and no chat template "
                    "(the audit's data)")  # fmt: skip
    args = ap.parse_args()
    if args.generate:
        return generate(args.out)
    args.out.mkdir(parents=True, exist_ok=True)
    write_model(args.out / "tiny-llama", chat=not args.pairs)
    rows, kind = (pairs, "pairs") if args.pairs else (conversations, "conversations")
    write_jsonl(args.out / "train.jsonl", rows(256, seed=0))
    write_jsonl(args.out / "val.jsonl", rows(32, seed=1))
    print(f"wrote {args.out}/tiny-llama, train.jsonl (256 {kind}) and val.jsonl (32)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
