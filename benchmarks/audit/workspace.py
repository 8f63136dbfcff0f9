"""The files every case starts from, built once (about a minute) and copied into each case's
own folder, so that a case's damage never reaches another case.

    base = build(Path("/tmp/audit/base"))

    base/tiny-llama/     a tiny Llama (2 layers, tied embeddings) saved by save_pretrained,
                         with its word-level tokenizer (tools/demo_text.py)
    base/data/           the same question/answer pairs as .jsonl, .json, .csv, .parquet and
                         .txt, and token ids as .pt and .jsonl; val.jsonl to evaluate on
    base/p1/, base/p2/   `ftpipe compile` of the model for 1 and for 2 ranks (plan.json,
                         report.html, the package tiny_llama_pipeline/)
    base/graph.json      `ftpipe profile` of the model
    base/ck/             a finished 2-rank run's checkpoints (steps 2 and 4, 1F1B)
    base/hf/             that run's --save-hf folder; base/log.json its --log-json
"""

from __future__ import annotations

import csv
import json
import shutil
import subprocess
import sys
from pathlib import Path

from benchmarks.harness.launch import ROOT, child_env

__all__ = ["PACKAGE", "SHAPE", "TRAIN_TEXT", "build", "package_argv"]

PACKAGE = "tiny_llama_pipeline"
SHAPE = ["--seq-len", "16", "--micro-batch", "4", "--batch", "16"]
# The data options of the question/answer files (what make demo trains on).
TRAIN_TEXT = ["--prompt-field", "question", "--target-field", "answer"]
GOOD_RUN = ["--steps", "4", "--save-every", "2", "--schedule", "1f1b", "--timeout", "20"]


def package_argv() -> list[str]:
    return [sys.executable, "-m", PACKAGE]


def build(base: Path, say=print) -> Path:
    """Make `base` (see the module); returns it."""
    if (base / "done").exists():
        return base
    shutil.rmtree(base, ignore_errors=True)
    base.mkdir(parents=True)
    _run([sys.executable, str(ROOT / "tools" / "demo_text.py"), str(base / "demo"), "--pairs"],
         base)  # fmt: skip
    shutil.move(base / "demo" / "tiny-llama", base / "tiny-llama")
    (base / "data").mkdir()
    shutil.move(base / "demo" / "train.jsonl", base / "data" / "train.jsonl")
    shutil.move(base / "demo" / "val.jsonl", base / "data" / "val.jsonl")
    shutil.rmtree(base / "demo")
    _data_formats(base / "data")
    say("audit: compiling the packages")
    ftpipe = [sys.executable, "-m", "ftpipe_compiler"]
    for gpus in (1, 2):
        _run(
            [*ftpipe, "compile", "-m", "tiny-llama", "-g", str(gpus), *SHAPE, "-o", f"p{gpus}"],
            base,
        )
    _run([*ftpipe, "profile", "-m", "tiny-llama", *SHAPE, "-o", "graph.json"], base)
    say("audit: a good two-rank run with checkpoints")
    data = ["--data", "../data/train.jsonl", *TRAIN_TEXT]
    outputs = ["--checkpoint-dir", "../ck", "--save-hf", "../hf", "--log-json", "../log.json"]
    launch_ranks(base / "p2", 2, [*GOOD_RUN, *data, *outputs], base / "store-good", base)
    (base / "done").write_text("")
    for leftover in base.glob("store-*"):
        leftover.unlink()
    for log in base.glob("rank*.log"):
        log.unlink()
    return base


def _run(cmd: list[str], cwd: Path) -> None:
    done = subprocess.run(cmd, cwd=cwd, env=child_env(), capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"{' '.join(cmd)} failed ({done.returncode}):\n{done.stderr[-3000:]}")


def launch_ranks(cwd: Path, world: int, argv: list[str], store: Path, logs: Path) -> None:
    """Run the package on `world` ranks meeting at a file store; raise if any fails."""
    procs = []
    for rank in range(world):
        env = child_env(extra=dict(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                                   LOCAL_WORLD_SIZE=str(world)))  # fmt: skip
        with open(logs / f"rank{rank}.log", "w") as log:
            cmd = [*package_argv(), "--init-method", f"file://{store}", *argv]
            procs.append(subprocess.Popen(cmd, cwd=cwd, env=env, stdout=log, stderr=log))
    codes = [p.wait(timeout=300) for p in procs]
    if any(codes):
        tails = "\n".join((logs / f"rank{r}.log").read_text()[-2000:] for r in range(world))
        raise RuntimeError(f"the good run failed ({codes}):\n{tails}")


def _data_formats(data: Path) -> None:
    """train.jsonl's pairs in every text format, and token ids as .pt and .jsonl."""
    import pandas as pd
    import torch

    rows = [json.loads(line) for line in (data / "train.jsonl").read_text().splitlines()]
    (data / "train.json").write_text(json.dumps(rows))
    with open(data / "train.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=["question", "answer"])
        writer.writeheader()
        writer.writerows(rows)
    pd.DataFrame(rows).to_parquet(data / "train.parquet")
    (data / "train.txt").write_text("".join(f"{r['question']} {r['answer']}\n" for r in rows))
    (data / "text.jsonl").write_text(
        "".join(json.dumps({"text": f"{r['question']} {r['answer']}"}) + "\n" for r in rows)
    )
    ids = torch.randint(4, 32, (64, 16), generator=torch.Generator().manual_seed(0))
    torch.save({"input_ids": ids, "labels": ids.clone()}, data / "tokens.pt")
    (data / "tokens.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ids.tolist()))
