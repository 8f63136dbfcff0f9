"""Text for fine-tuning tests: the demo's pieces (`tools/demo_text.py`) and tiny packages.

texts = sentences(40, seed=0)                 # ["seven two nine ...", ...]
make_data(CAUSAL, path, 0, options, tok)      # CAUSAL: a causal LM of L = 16 tokens
write_tokenizer(folder, "llama")              # AutoTokenizer.from_pretrained(folder)
packages = tiny_models(root)                  # {"llama": pkg folder, "t5": pkg folder}
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))
from demo_text import WORDS, pairs, sentences, write_jsonl, write_model, write_tokenizer  # noqa: E402

__all__ = ["CAUSAL", "L", "WORDS", "eval_loss", "pairs", "sentences", "tiny_models",
           "write_jsonl", "write_tokenizer"]  # fmt: skip

# A causal LM's plan entry as the data readers see it: 2 x 16 tokens, 32 ids.
L = 16
CAUSAL = {
    "head": "causal-lm",
    "vocab": {"vocab_size": 32},
    "inputs": {"input_ids": [[2, L], "int64"], "attention_mask": [[2, L], "int64"],
               "labels": [[2, L], "int64"]},
}  # fmt: skip


def eval_loss(net, plan: dict, path: Path, text) -> float:
    """The evaluation loss as the pipeline defines it (samples of a text file under the
    TextOptions `text`, each batch weighted by its samples), of a model in one process."""
    import torch
    from ftpipe_runtime.data.batches import make_data
    from ftpipe_runtime.models.hf import loss_of

    data = make_data(plan["model"], str(path), 0, text, plan["model"]["path"], evaluation=True)
    total = samples = 0.0
    with torch.no_grad():
        for j in range(data.micro_batches):
            batch = {n: data.get(n, j) for n in plan["model"]["inputs"]}
            total += float(loss_of(net, batch)) * data.weight(j)
            samples += data.weight(j)
    return total / samples


def tiny_models(root: Path) -> dict[str, Path]:
    """Tiny Llama (tied embeddings) and T5 folders, each with its tokenizer, compiled for 2
    GPUs (16 tokens; T5: 8 target tokens): model name -> the package folder."""
    from click.testing import CliRunner

    from ftpipe_compiler.cli import cli

    out = {}
    for name in ("llama", "t5"):
        folder = write_model(root / "models" / name, name)
        shape = ["--seq-len", "16", "--micro-batch", "2", "--batch", "4"]
        shape += ["--target-len", "8"] if name == "t5" else []
        args = ["compile", "--model", str(folder), "--gpus", "2", *shape, "-o", str(root / name)]
        result = CliRunner().invoke(cli, args)
        assert result.exit_code == 0, result.output
        out[name] = root / name / f"{name}_pipeline"
    return out
