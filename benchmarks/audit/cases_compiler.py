"""The `ftpipe` command's cases: bad options, damaged model folders (config.json, safetensors
and their index), damaged plans and graphs, outputs that cannot be written, signals.
Exit codes (README): 0 done, 1 a failure named in one sentence, 2 a usage error, 130 Ctrl-C,
143 SIGTERM."""

from __future__ import annotations

import json
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path

from .damage import (
    both,
    copy,
    edit_json,
    folder_instead,
    full_disk,
    garbage,
    link_loop,
    read_only,
    said,
    truncate,
    write,
)
from .harness import Case, Ftpipe
from .workspace import SHAPE

__all__ = ["CASES"]

LLAMA = ["-m", "tiny-llama", *SHAPE]
COMPILE = ["compile", *LLAMA, "-g", "2", "-o", "new"]
GPT2 = ["compile", "-m", "gpt2-tiny", "-g", "2"]
CONFIG = "tiny-llama/config.json"
T5_3B = ("compile", "-m", "t5-3b", "-g", "8", "-o", "t5", "--force")  # 30 s and more
WEIGHTS = "tiny-llama/model.safetensors"
INJECTED = 'o\nimport os;os.system("touch PWN")\n#'


def _config(what: str, **changes):
    return edit_json(CONFIG, lambda c: c.update(changes), what)


def _tensors(what: str, change):
    """model.safetensors rewritten with `change(tensors)` applied (a dict of tensors)."""

    @said(what)
    def setup(folder: Path):
        from safetensors.torch import load_file, save_file

        tensors = load_file(folder / WEIGHTS)
        change(tensors)
        save_file(tensors, folder / WEIGHTS, metadata={"format": "pt"})

    return setup


def _sharded(what: str, change=None):
    """The weights as two shards with their index (save_pretrained's layout); `change(index)`
    edits the index."""

    @said(what)
    def setup(folder: Path):
        from safetensors.torch import load_file, save_file

        model = folder / "tiny-llama"
        tensors = load_file(model / "model.safetensors")
        (model / "model.safetensors").unlink()
        names = sorted(tensors)
        half = len(names) // 2
        index = {"metadata": {}, "weight_map": {}}
        for i, part in enumerate((names[:half], names[half:])):
            shard = f"model-0000{i + 1}-of-00002.safetensors"
            save_file({n: tensors[n] for n in part}, model / shard, metadata={"format": "pt"})
            index["weight_map"].update({n: shard for n in part})
        if change is not None:
            change(index, model)
        (model / "model.safetensors.index.json").write_text(json.dumps(index))

    return setup


def _header_claims(size: int):
    @said(f"model.safetensors' header says it is {size} bytes long")
    def setup(folder: Path):
        p = folder / WEIGHTS
        data = p.read_bytes()
        p.write_bytes(struct.pack("<Q", size) + data[8:])

    return setup


def _deberta(folder: Path):
    """a DeBERTa-v2 classifier folder whose loss torch.export cannot trace"""
    config = {"model_type": "deberta-v2", "architectures": ["DebertaV2ForSequenceClassification"],
              "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2,
              "intermediate_size": 64, "vocab_size": 128, "max_position_embeddings": 64}  # fmt: skip
    (folder / "deberta").mkdir()
    (folder / "deberta" / "config.json").write_text(json.dumps(config))


def _pwned(folder: Path) -> str | None:
    """Import the generated package; the injected line must not have run."""
    out = next((p for p in folder.iterdir() if p.name.startswith("o\n")), None)
    if out is None:
        return "no output folder"
    subprocess.run(
        [sys.executable, "-c", "import gpt2_tiny_pipeline"], cwd=out, capture_output=True
    )
    if (out / "PWN").exists() or (folder / "PWN").exists():
        return "the injected line ran"
    return None


def _signal_after(sig, seconds: float):
    """Send `sig` to the command `seconds` after it started (mid-compile)."""

    def during(procs, folder):
        time.sleep(seconds)
        procs[0].popen.send_signal(sig)

    during.__doc__ = f"{signal.Signals(sig).name} {seconds:g} s into it"
    return during


def _signal_on(sig, text: str):
    """Send `sig` to the command once it printed `text` (a phase's end: the next one has begun).
    A fixed delay missed it once compiles got faster: T5-3B's whole compile takes 7 s now, and
    a signal 20 s in found it done."""

    def during(procs, folder):
        deadline = time.monotonic() + 150
        while text not in procs[0].text() and time.monotonic() < deadline:
            if procs[0].popen.poll() is not None:
                return
            time.sleep(0.05)
        procs[0].popen.send_signal(sig)

    during.__doc__ = f"{signal.Signals(sig).name} once it printed {text!r}"
    return during


def _cluster(data):
    return write("c.json", json.dumps(data) if not isinstance(data, str) else data)


GOOD_LINK = {"bandwidth": 1e10}
CLUSTER = {"gpu": "rtx2080ti", "gpus_per_node": 2, "intra_node": GOOD_LINK,
           "inter_node": GOOD_LINK}  # fmt: skip
ON_CLUSTER = ["compile", "-m", "gpt2-tiny", "-g", "4", "--cluster", "c.json", "-o", "new"]

CASES = [
    # issue 32's cases
    Case("compile: code in the output path", Ftpipe(("compile", "-m", "gpt2-tiny", "-g", "2", "-o", INJECTED)), 0, damage="-o holds a newline and a line of Python", after=_pwned, issue="32.1"),
    Case("compile: a config of -2 layers", Ftpipe(tuple(COMPILE)), 1, "num_hidden_layers -2", setup=_config("config.json: num_hidden_layers -2", num_hidden_layers=-2), issue="32.3"),
    Case("compile: weights of random bytes", Ftpipe(tuple(COMPILE)), 1, "not a readable safetensors file", setup=garbage(WEIGHTS), issue="32.3"),
    # It failed to trace (issue 32.2) until its head implied its problem_type: now it profiles.
    Case("profile: a DeBERTa-v2 classifier without problem_type", Ftpipe(("profile", "-m", "deberta", "--seq-len", "32")), 0, setup=_deberta, issue="32.2"),
    Case("compile: -o on a full disk", Ftpipe((*COMPILE[:-1], "disk/new")), 1, "No space left", setup=full_disk("disk"), needs_root=True, issue="32.2"),
    Case("compile --force: -o on a full disk, over an earlier output", Ftpipe((*COMPILE[:-1], "disk/p2", "--force")), 1, "No space left", setup=both(copy("p2", "disk/p2"), full_disk("disk", keep=("disk/p2",)), what="disk/p2 an earlier output on a full disk"), needs_root=True, issue="32.2"),
    Case("profile: -o on a full disk", Ftpipe(("profile", *LLAMA, "-o", "disk/graph.json")), 1, "No space left", setup=full_disk("disk"), needs_root=True, issue="32.2"),
    # options
    Case("compile --force: -o the model's own folder", Ftpipe(("compile", *LLAMA, "-g", "2", "-o", "tiny-llama", "--force")), 1, "holds the model folder|is the model folder"),
    Case("compile --force: -o a folder of the user's files", Ftpipe((*COMPILE[:-1], "mine", "--force")), 1, "holds files ftpipe compile does not write", setup=write("mine/notes.txt", "the user's own notes", what="mine/ holds the user's notes.txt")),
    Case("simulate: --report over the plan it reads", Ftpipe(("simulate", "p2/plan.json", "--report", "p2/plan.json")), 1, "which this command reads"),
    Case("compile: --gpus 0", Ftpipe(("compile", *LLAMA, "-g", "0", "-o", "new")), 2, "0 is not in the range"),
    Case("compile: --gpus a word", Ftpipe(("compile", *LLAMA, "-g", "two", "-o", "new")), 2, "'two' is not a valid integer"),
    Case("compile: --seq-len 10^6", Ftpipe(("compile", "-m", "tiny-llama", "-g", "2", "--seq-len", "1000000", "-o", "new")), 1, "positions"),
    Case("compile: --micro-batch 10^9", Ftpipe(("compile", "-m", "tiny-llama", "-g", "2", "--seq-len", "16", "--micro-batch", "1000000000", "-o", "new")), 1),
    Case("compile: --batch not a multiple of --micro-batch", Ftpipe(("compile", "-m", "tiny-llama", "-g", "2", "--seq-len", "16", "--micro-batch", "4", "--batch", "6", "-o", "new")), 1, "not a multiple"),
    Case("compile: --hardware unknown", Ftpipe((*COMPILE, "--hardware", "tpu9")), 2, "unknown hardware 'tpu9'"),
    Case("compile: --hardware a path outside the configs", Ftpipe((*COMPILE, "--hardware", "../models/gpt2-tiny")), 2, "unknown hardware '../models/gpt2-tiny'"),
    Case("compile: --partitioners unknown", Ftpipe((*COMPILE, "-p", "magic")), 2, "unknown partitioner 'magic'"),
    Case("compile: --steps 1", Ftpipe((*COMPILE, "--steps", "1")), 2, "1 is not in the range x>=2"),
    Case("compile: an unknown option", Ftpipe((*COMPILE, "--turbo")), 2, "No such option '--turbo'"),
    Case("compile: an unknown model name", Ftpipe(("compile", "-m", "gpt-7", "-g", "2", "-o", "new")), 1, "gpt-7"),
    Case("compile: fp16 under the asynchronous schedule only", Ftpipe((*COMPILE, "--dtype", "fp16", "--schedule", "ftpipe")), 1, "does not step them together"),
    # cluster files
    Case("compile: --cluster not JSON", Ftpipe(tuple(ON_CLUSTER)), 1, "not valid JSON", setup=_cluster("{gpu: rtx")),
    Case("compile: --cluster a JSON list", Ftpipe(tuple(ON_CLUSTER)), 1, "a cluster must be a JSON object", setup=_cluster([1, 2])),
    Case("compile: --cluster of NaN bandwidth", Ftpipe(tuple(ON_CLUSTER)), 1, "bandwidth must be positive", setup=_cluster('{"gpu": "rtx2080ti", "gpus_per_node": 2, "intra_node": {"bandwidth": NaN}, "inter_node": {"bandwidth": 1e10}}')),
    Case("compile: --cluster of an unknown GPU", Ftpipe(tuple(ON_CLUSTER)), 1, "unknown hardware", setup=_cluster({**CLUSTER, "gpu": "nope"})),
    Case("compile: --cluster of a GPU object missing fields", Ftpipe(tuple(ON_CLUSTER)), 1, "are required", setup=_cluster({**CLUSTER, "gpu": {"name": "x"}})),
    # outputs
    Case("compile: -o an existing file", Ftpipe((*COMPILE[:-1], "afile")), 2, "is a file", setup=write("afile", "mine")),
    Case("compile: -o a symlink to itself", Ftpipe((*COMPILE[:-1], "loop")), 1, "Symlink loop", setup=link_loop("loop")),
    Case("compile: -o on a read-only file system", Ftpipe((*COMPILE[:-1], "ro/new")), 1, setup=read_only("ro"), needs_root=True),
    Case("compile --force: over an output on a read-only file system", Ftpipe((*COMPILE[:-1], "ro/p2", "--force")), 1, setup=both(copy("p2", "ro/p2"), read_only("ro", keep=("ro/p2",)), what="ro/p2 an earlier output on a read-only file system"), needs_root=True),
    Case("compile: Ctrl-C while it starts, over an output", Ftpipe((*COMPILE[:-1], "p2", "--force")), 130, "nterrupted \\(Ctrl-C\\)", during=_signal_after(signal.SIGINT, 2.0)),
    Case("compile: Ctrl-C mid-planning (T5-3B), over an output", Ftpipe(T5_3B), 130, "Interrupted \\(Ctrl-C\\)", setup=copy("p2", "t5"), during=_signal_on(signal.SIGINT, "compile: trace and profile")),
    Case("compile: SIGTERM mid-planning (T5-3B), over an output", Ftpipe(T5_3B), 143, "Stopped \\(SIGTERM\\)", setup=copy("p2", "t5"), during=_signal_on(signal.SIGTERM, "compile: trace and profile")),
    Case("compile: valid, a unicode model folder", Ftpipe(("compile", "-m", "модель-ü", *SHAPE, "-g", "2", "-o", "выход")), 0, setup=copy("tiny-llama", "модель-ü")),
    Case("compile --force: valid, over an earlier output", Ftpipe((*COMPILE[:-1], "p2", "--force")), 0, writes=("p2/",)),
    # config.json
    Case("compile: config.json empty", Ftpipe(tuple(COMPILE)), 1, "not valid JSON", setup=truncate(CONFIG, 0)),
    Case("compile: config.json a folder", Ftpipe(tuple(COMPILE)), 1, setup=folder_instead(CONFIG)),
    Case("compile: config.json a symlink to itself", Ftpipe(tuple(COMPILE)), 1, setup=link_loop(CONFIG)),
    Case("compile: the model folder a symlink to itself", Ftpipe(("compile", "-m", "loop", *SHAPE, "-g", "2", "-o", "new")), 1, setup=link_loop("loop")),
    Case("compile: hidden_size NaN", Ftpipe(tuple(COMPILE)), 1, "hidden_size", setup=_config("config.json: hidden_size NaN", hidden_size=float("nan"))),
    Case("compile: heads not dividing the width", Ftpipe(tuple(COMPILE)), 1, "not a multiple", setup=_config("config.json: num_attention_heads 5, hidden_size 32", num_attention_heads=5, head_dim=None)),
    Case("compile: a count as text", Ftpipe(tuple(COMPILE)), 1, "num_attention_heads", setup=_config('config.json: num_attention_heads "four"', num_attention_heads="four")),
    Case("compile: an architecture transformers lacks", Ftpipe(tuple(COMPILE)), 1, "NoSuchForCausalLM", setup=_config("config.json: architectures [NoSuchForCausalLM]", architectures=["NoSuchForCausalLM"])),
    Case("compile: an unknown model_type", Ftpipe(tuple(COMPILE)), 1, "llama9", setup=_config("config.json: model_type 'llama9'", model_type="llama9")),
    # safetensors and their index
    Case("compile: weights cut short", Ftpipe(tuple(COMPILE)), 1, "model.safetensors", setup=truncate(WEIGHTS)),
    Case("compile: a header claiming 2^63 bytes", Ftpipe(tuple(COMPILE)), 1, "model.safetensors", setup=_header_claims(2**63)),
    Case("compile: a weight of the wrong shape", Ftpipe(tuple(COMPILE)), 1, "is \\[31, 32\\] in the folder, \\[32, 32\\] in the model", setup=_tensors("model.embed_tokens.weight stored as 31 x 32", lambda t: t.update({"model.embed_tokens.weight": t["model.embed_tokens.weight"][:31].clone()}))),
    Case("compile: valid, sharded weights", Ftpipe(tuple(COMPILE)), 0, setup=_sharded("the weights in two shards and their index")),
    Case("compile: a shard the index names is missing", Ftpipe(tuple(COMPILE)), 1, "00002", setup=_sharded("two shards; the second removed", lambda index, model: (model / "model-00002-of-00002.safetensors").unlink())),
    Case("compile: the shard index cut short", Ftpipe(tuple(COMPILE)), 1, "index", setup=both(_sharded("two shards"), truncate("tiny-llama/model.safetensors.index.json"), what="two shards; their index cut to half")),
    Case("compile: the index maps a weight to the wrong shard", Ftpipe(tuple(COMPILE)), 1, setup=_sharded("two shards; the index names the other shard for one weight", lambda index, model: index["weight_map"].update({"model.norm.weight": "model-00001-of-00002.safetensors" if index["weight_map"]["model.norm.weight"].startswith("model-00002") else "model-00002-of-00002.safetensors"}))),
    # plans, graphs and simulate
    Case("simulate: plan.json empty", Ftpipe(("simulate", "p2/plan.json")), 1, "not valid JSON", setup=truncate("p2/plan.json", 0)),
    Case("simulate: a stage time NaN", Ftpipe(("simulate", "p2/plan.json")), 1, "negative or non-finite", setup=edit_json("p2/plan.json", lambda p: p["stages"][0].update(fwd_s=float("nan")), "plan.json: stage 0's fwd_s NaN")),
    Case("simulate: plan.json a symlink to itself", Ftpipe(("simulate", "p2/plan.json")), 1, setup=link_loop("p2/plan.json")),
    Case("simulate: --steps 10^9", Ftpipe(("simulate", "p2/plan.json", "--steps", "1000000000")), 1, "actions to simulate"),
    Case("simulate: --micro-batches 10^7", Ftpipe(("simulate", "p2/plan.json", "-M", "10000000")), 1, "actions to simulate"),
    Case("compile: --micro-batches 10^7 against --batch", Ftpipe((*COMPILE, "--micro-batches", "10000000")), 2, "--batch 16 is not --micro-batches 10000000 x micro-batch 4"),
    Case("simulate: --schedule a CSV of garbage", Ftpipe(("simulate", "p2/plan.json", "--schedule", "mine.csv")), 1, "mine.csv", setup=write("mine.csv", "0F0,zz,\x00\n")),
    Case("simulate: --report on a read-only file system", Ftpipe(("simulate", "p2/plan.json", "--report", "ro/r.html")), 1, setup=read_only("ro"), needs_root=True),
    Case("simulate: --report on a full disk", Ftpipe(("simulate", "p2/plan.json", "--report", "disk/r.html")), 1, "No space left", setup=full_disk("disk"), needs_root=True, issue="32.2"),
    Case("simulate: --compare a trace that is not one", Ftpipe(("simulate", "p2/plan.json", "--compare", "log.json")), 1),
    Case("partition: graph.json cut short", Ftpipe(("partition", "graph.json", "-g", "2")), 1, "not valid JSON", setup=truncate("graph.json")),
    Case("partition: a node cost NaN", Ftpipe(("partition", "graph.json", "-g", "2")), 1, "non-finite cost", setup=edit_json("graph.json", lambda g: g["nodes"][3].update(fwd_s=float("nan")), "graph.json: a node's fwd_s NaN")),
    Case("partition: valid, --gpus 10^6 (kept on the GPUs it uses)", Ftpipe(("partition", "graph.json", "-g", "1000000", "-o", "plan-many.json")), 0),
    Case("models: valid, --json", Ftpipe(("models", "--json")), 0),
]  # fmt: skip
