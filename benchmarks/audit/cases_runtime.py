"""A package's cases on one process (the package compiled for 1 rank, run in p1/): bad
options, data files of every format damaged, tokenizers, weights, --init, outputs that
cannot be written, `export` and `--check`. Exit codes (README): 0 done, 1 a failure named
in one sentence, 2 a usage error."""

from __future__ import annotations

import json
import pickle
from pathlib import Path

from .damage import (
    both,
    copy,
    full_disk,
    garbage,
    link_loop,
    read_only,
    said,
    truncate,
    write,
)
from .harness import Case, Package
from .workspace import TRAIN_TEXT

__all__ = ["CASES"]

TEXT = ("--data", "../data/train.jsonl", *TRAIN_TEXT)
STEPS = ("--steps", "2")
WEIGHTS = "weights/model.safetensors"  # $FTPIPE_WEIGHTS's folder: a copy of the model's


def run(*args, gpus=1, **kw) -> Package:
    return Package(gpus, (*STEPS, *args), **kw)


def data(name: str, *more) -> Package:
    return run("--data", f"../data/{name}", *more)


def export(*args) -> Package:
    return Package(2, ("export", "--checkpoint-dir", "../ck", *args), ranks=1, world_env=False)


def check(*args, env=None) -> Package:
    return Package(1, ("--check", *args), env=env or {})


def _weights(*damage):
    return both(copy("tiny-llama", "weights"), *damage)


WEIGHTS_ENV = {"FTPIPE_WEIGHTS": "../weights"}


class _Pickled:
    """A pickle that runs a command when loaded."""

    def __reduce__(self):
        import os

        return (os.system, ("touch PWN",))


def _pickle(path: str):
    @said(f"{path}: a pickle that runs `touch PWN` when loaded")
    def setup(folder: Path):
        (folder / path).parent.mkdir(parents=True, exist_ok=True)
        (folder / path).write_bytes(pickle.dumps({"input_ids": _Pickled()}))

    return setup


def _not_pwned(folder: Path) -> str | None:
    return "the pickle ran" if any(folder.rglob("PWN")) else None


def _big_vocab_tokenizer(folder: Path):
    """a tokenizer of 60 words (the model has 32 ids): ids past the model's vocabulary"""
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))
    from demo_text import write_tokenizer

    words = [f"w{i}" for i in range(56)]
    write_tokenizer(folder / "tok", words=words)
    (folder / "data" / "w.jsonl").write_text(
        "".join(json.dumps({"text": " ".join(words[i : i + 5])}) + "\n" for i in range(0, 50, 5))
    )


def _user_files(path: str):
    return write(
        f"{path}/notes.txt", "the user's own notes", what=f"{path}/ holds the user's notes.txt"
    )


CASES = [
    # options
    Case("run: --steps -1", run("--steps", "-1"), 2, "-1 must be at least 1"),
    Case("run: --lr 1e400 (inf)", run("--lr", "1e400"), 2, "not a finite number"),
    Case("run: --seed 10^30", run("--seed", "1" + "0" * 30), 2, "must be below"),
    Case("run: --micro-batches 10^9", run("--micro-batches", "1000000000"), 2, "must be at most 65536"),
    Case("run: --freeze-at not STEP:LAYERS", run("--freeze-at", "soon"), 2),
    Case("run: --schedule a missing CSV", run("--schedule", "mine.csv"), 1, "mine.csv"),
    Case("run: --schedule a CSV of garbage", run("--schedule", "mine.csv"), 1, "mine.csv", setup=write("p1/mine.csv", "0F0,\x00zz\n")),
    Case("run: --optimizer unknown", run("--optimizer", "lion"), 2, "invalid choice: 'lion'"),
    Case("run: --device cuda without a GPU", run("--device", "cuda"), 1, "sees no GPU"),
    # data, valid in every format
    Case("run: valid, .csv text", data("train.csv", *TRAIN_TEXT), 0),
    Case("run: valid, .parquet text", data("train.parquet", *TRAIN_TEXT), 0),
    Case("run: valid, .txt text", data("train.txt"), 0),
    Case("run: valid, .pt token ids", data("tokens.pt"), 0),
    # data, damaged
    Case("run: .parquet cut short", data("train.parquet", *TRAIN_TEXT), 1, "train.parquet", setup=truncate("data/train.parquet")),
    Case("run: .csv of a header only", data("train.csv", *TRAIN_TEXT), 1, "train.csv", setup=write("data/train.csv", "question,answer\n")),
    Case("run: .csv with a NUL byte", data("train.csv", *TRAIN_TEXT), 1, "NUL byte", setup=write("data/train.csv", "question,answer\none\x00two,three\n")),
    Case("run: .json of an object", data("train.json", *TRAIN_TEXT), 1, "train.json", setup=write("data/train.json", '{"question": "one"}')),
    Case("run: .txt of binary bytes", data("train.txt"), 1, "train.txt", setup=garbage("data/train.txt")),
    Case("run: valid, .jsonl with a byte-order mark", data("text.jsonl"), 0, setup=said("text.jsonl begins with a UTF-8 byte-order mark")(lambda f: (f / "data/text.jsonl").write_bytes(b"\xef\xbb\xbf" + (f / "data/text.jsonl").read_bytes()))),
    Case("run: a text of 1 MB", data("text.jsonl"), 1, "more than the 16", setup=write("data/text.jsonl", json.dumps({"text": "one " * 250000}) + "\n")),
    Case("run: --data a folder", run("--data", "../data"), 1, "data"),
    Case("run: --data a symlink to itself", run("--data", "../data/loop.jsonl"), 1, "loop.jsonl", setup=link_loop("data/loop.jsonl")),
    Case("run: token ids 10^30 in .jsonl", data("tokens.jsonl"), 1, "tokens.jsonl", setup=write("data/tokens.jsonl", "[1, 2, 1000000000000000000000000000000]\n")),
    Case("run: token ids in .jsonl, invalid UTF-8", data("tokens.jsonl"), 1, "line 2 \\(byte 37\\) is not UTF-8", setup=write("data/tokens.jsonl", b'[1, 2, 3]\n{"input_ids": [4, 5], "note\xff": [1]}\n')),
    Case("run: token ids in a .pt pickle that runs code", data("tokens.pt"), 1, "tokens.pt", setup=_pickle("data/tokens.pt"), after=_not_pwned),
    # tokenizers
    Case("run: --tokenizer a missing folder", run(*TEXT, "--tokenizer", "../nowhere"), 1, "nowhere"),
    Case("run: tokenizer.json cut short", run(*TEXT, "--tokenizer", "../tok"), 1, "tok", setup=both(copy("tiny-llama", "tok"), truncate("tok/tokenizer.json"))),
    Case("run: a tokenizer of more ids than the model", run("--data", "../data/w.jsonl", "--tokenizer", "../tok"), 1, "vocabulary", setup=_big_vocab_tokenizer),
    # the weights a stage loads ($FTPIPE_WEIGHTS)
    Case("run: $FTPIPE_WEIGHTS cut short", run(env=WEIGHTS_ENV), 1, "model.safetensors", setup=_weights(truncate(WEIGHTS))),
    Case("run: $FTPIPE_WEIGHTS of random bytes", run(env=WEIGHTS_ENV), 1, "model.safetensors", setup=_weights(garbage(WEIGHTS))),
    Case("run: $FTPIPE_WEIGHTS a missing folder", run(env={"FTPIPE_WEIGHTS": "../nowhere"}), 1, "nowhere"),
    Case("run: $FTPIPE_WEIGHTS a folder without weights", run(env={"FTPIPE_WEIGHTS": "../tok"}), 1, "tok", setup=write("tok/readme.txt", "no weights here")),
    # --init
    Case("run: --init a pickle that runs code", run("--init", "w.pt"), 1, "not a state dict", setup=_pickle("p1/w.pt"), after=_not_pwned, issue="32"),
    Case("run: --init .safetensors cut short", run("--init", "../tiny-llama/model.safetensors"), 1, "model.safetensors", setup=truncate("tiny-llama/model.safetensors")),
    # outputs
    Case("run: --log-json on a read-only file system", run("--log-json", "../ro/log.json"), 1, "log.json", setup=read_only("ro"), needs_root=True),
    Case("run: --log-json on a full disk", run("--log-json", "../disk/log.json"), 1, "No space left", setup=both(copy("log.json", "disk/log.json"), full_disk("disk", keep=("disk/log.json",)), what="disk/log.json an earlier log on a full disk"), needs_root=True, issue="32.2"),
    Case("run: --log-dir a file", run("--log-dir", "../log.json"), 1, "log.json"),
    Case("run: --save-hf a file", run("--save-hf", "../log.json"), 1, "is a file"),
    Case("run: --save-hf a folder of the user's files", run("--save-hf", "../mine"), 1, "mine", setup=_user_files("mine")),
    Case("run: --log-json the data file", data("text.jsonl", "--log-json", "../data/text.jsonl"), 1, "is the --data file"),
    Case("run: --log-jsonl the package's plan.json", run("--log-jsonl", "tiny_llama_pipeline/plan.json"), 1, "is a file of the package"),
    Case("run: --save-hf the model's own folder", run("--save-hf", "../tiny-llama"), 1, "would replace the model's folder"),
    Case("run: valid, --save-hf over an earlier export", run("--save-hf", "../hf"), 0, writes=("hf/",)),
    Case("run: --save-hf on a full disk", run("--save-hf", "../disk/hf"), 1, "No space left", setup=full_disk("disk", size="64k"), needs_root=True, issue="32.2"),
    Case("run: --save-hf on a read-only file system", run("--save-hf", "../ro/hf"), 1, "hf", setup=read_only("ro"), needs_root=True),
    Case("run: --checkpoint-dir on a full disk", run("--save-every", "1", "--checkpoint-dir", "../disk/ck"), 1, "No space left", setup=full_disk("disk"), needs_root=True, issue="32.2"),
    Case("run: --checkpoint-dir a symlink to itself", run("--save-every", "1", "--checkpoint-dir", "../loop"), 1, "loop", setup=link_loop("loop")),
    # export
    Case("export: valid", export("-o", "../out"), 0),
    Case("export: valid, over an earlier export", export("-o", "../hf"), 0, writes=("hf/",)),
    Case("export: into a folder of the user's files", export("-o", "../mine"), 1, "mine", setup=_user_files("mine")),
    Case("export: -o a file", export("-o", "../log.json"), 1, "log.json"),
    Case("export: --step 3 (none there)", export("--step", "3", "-o", "../out"), 1, "no complete checkpoint of step 3"),
    Case("export: a stage file cut short", export("-o", "../out"), 1, "damaged", setup=truncate("ck/step-000004/stage-0.safetensors")),
    Case("export: a manifest not JSON", export("--step", "4", "-o", "../out"), 1, "step-000004 is damaged", setup=write("ck/step-000004/rank-1.json", "{oops")),
    Case("export: an empty checkpoint folder", Package(2, ("export", "--checkpoint-dir", "../empty", "-o", "../out"), ranks=1, world_env=False), 1, "no complete checkpoint", setup=write("empty/.keep", "")),
    Case("export: another plan's checkpoints", Package(1, ("export", "--checkpoint-dir", "../ck", "-o", "../out"), world_env=False), 1, "another plan"),
    Case("export: onto a read-only file system", export("-o", "../ro/out"), 1, "out", setup=read_only("ro"), needs_root=True),
    Case("export: onto a full disk", export("-o", "../disk/out"), 1, "No space left", setup=full_disk("disk", size="64k"), needs_root=True, issue="32.2"),
    Case("export: --max-shard-size not a size", export("-o", "../out", "--max-shard-size", "huge"), 2, "'huge' is not a size"),
    # --check
    Case("check: valid", check(), 0),
    Case("check: plan.json cut short", check(), 1, "not valid JSON", setup=truncate("p1/tiny_llama_pipeline/plan.json"), issue="32.2"),
    Case("check: $FTPIPE_WEIGHTS cut short", check(env=WEIGHTS_ENV), 1, "model.safetensors", setup=_weights(truncate(WEIGHTS))),
]  # fmt: skip
