"""Text for fine-tuning tests: sentences, a tokenizer trained on them, tiny model folders.

    texts = sentences(40, seed=0)                       # ["seven two nine ...", ...]
    write_tokenizer(folder, texts, style="llama")         # AutoTokenizer.from_pretrained(folder)
    write_pairs(path, 40, seed=0)                         # jsonl of {"question", "answer"}

The tokenizer is a word-level one trained with `tokenizers` and saved as a
`PreTrainedTokenizerFast`, so `AutoTokenizer` loads it as it loads any model's. "llama" style
starts every text with <s>; "t5" style ends it with </s>.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

WORDS = ("zero one two three four five six seven eight nine ten eleven twelve").split()
SPECIAL = ["<pad>", "<unk>", "<s>", "</s>"]


def sentences(n: int, seed: int = 0, low: int = 3, high: int = 8) -> list[str]:
    """Counting runs ("four five six seven"): learnable, so a loss can fall in a few steps."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        start, length = rng.randrange(len(WORDS)), rng.randint(low, high)
        out.append(" ".join(WORDS[(start + i) % len(WORDS)] for i in range(length)))
    return out


def pairs(n: int, seed: int = 0) -> list[dict]:
    """{"question": a counting run, "answer": the words that follow it}."""
    rows = []
    for text in sentences(n, seed, 3, 6):
        words = text.split()
        nxt = WORDS.index(words[-1]) + 1
        rows.append(
            {"question": text, "answer": " ".join(WORDS[(nxt + i) % len(WORDS)] for i in range(2))}
        )
    return rows


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def write_tokenizer(folder: Path, style: str = "llama", words=WORDS):
    """A word-level tokenizer of `words` in `folder`, loadable with AutoTokenizer."""
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
    folder.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(str(folder))
    return fast


def tiny_models(root: Path) -> dict[str, Path]:
    """Tiny Llama (tied embeddings) and T5 folders, each with its trained tokenizer, compiled
    for 2 GPUs (16 tokens; T5: 8 target tokens): model name -> the package folder."""
    import torch
    import transformers
    from click.testing import CliRunner

    from ftpipe_compiler.cli import cli

    configs = {
        "llama": transformers.LlamaConfig(
            hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=32, max_position_embeddings=64,
            tie_word_embeddings=True, attention_dropout=0.0, bos_token_id=2, eos_token_id=3,
            pad_token_id=0,
        ),
        "t5": transformers.T5Config(
            d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4, vocab_size=32,
            decoder_start_token_id=0, dropout_rate=0.0, eos_token_id=3, pad_token_id=0,
        ),
    }  # fmt: skip
    classes = {"llama": "LlamaForCausalLM", "t5": "T5ForConditionalGeneration"}
    out = {}
    for name, config in configs.items():
        folder = root / "models" / name
        torch.manual_seed(0)
        getattr(transformers, classes[name])(config).save_pretrained(folder)
        write_tokenizer(folder, "llama" if name == "llama" else "t5")
        shape = ["--seq-len", "16", "--micro-batch", "2", "--batch", "4"]
        shape += ["--target-len", "8"] if name == "t5" else []
        args = ["compile", "--model", str(folder), "--gpus", "2", *shape, "-o", str(root / name)]
        result = CliRunner().invoke(cli, args)
        assert result.exit_code == 0, result.output
        out[name] = root / name / f"{name}_pipeline"
    return out
