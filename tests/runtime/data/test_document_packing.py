"""Packed documents lose what they lose alone: a tiny Llama (the demo's, with its tokenizer)
compiled with `ftpipe compile --pack` into 2 stages, texts packed by the runtime.

- Each document of a packed row, its loss taken alone (labels of the other documents ignored),
  equals the loss of the document run unpacked, on its own, with the same weights: on the
  unpartitioned HuggingFace model and through the package's 2 generated stages chained as the
  pipeline chains them (fp32, within 1e-5). The same packed rows with positions running on
  and attention across documents (what --pack did before) are off by far more.
- 2 CPU ranks (torchrun, gloo) train 4 steps on the packed text (1F1B, AdamW, clipping at 1):
  the losses equal single-process training of the HuggingFace model on the same packed rows
  (rtol 1e-4).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from ftpipe_runtime.data.batches import IGNORE, TextOptions, make_data
from ftpipe_runtime.stage.api import run_in_one_process
from runtime_helpers import RUNTIME_HOME, plan_json
from runtime_reference import train_plain
from text_helpers import sentences, write_jsonl

transformers = pytest.importorskip("transformers")
pytest.importorskip("datasets")
from click.testing import CliRunner  # noqa: E402
from demo_text import write_model  # noqa: E402
from ftpipe_runtime.models.hf import loss_of  # noqa: E402

from ftpipe_compiler.cli import cli  # noqa: E402
from ftpipe_compiler.codegen import check_package, import_package  # noqa: E402

L = 32
PACK = TextOptions(pack=True)
TOLERANCE = 1e-5
STEPS, LR, CLIP = 4, 0.01, 1.0


@pytest.fixture(scope="module")
def packed(tmp_path_factory):
    """(root, package, plan, HuggingFace model): the demo's Llama compiled with --pack."""
    root = tmp_path_factory.mktemp("docpack")
    folder = write_model(root / "models" / "llama", "llama")
    args = ["compile", "--model", str(folder), "--gpus", "2", "--seq-len", str(L),
            "--micro-batch", "2", "--batch", "4", "--schedule", "1f1b", "--pack",
            "-o", str(root / "out")]  # fmt: skip
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 0, result.output
    write_jsonl(root / "train.jsonl", [{"text": t} for t in sentences(40, seed=0)])
    pkg = root / "out" / "llama_pipeline"
    net = transformers.LlamaForCausalLM.from_pretrained(folder).eval()
    return root, pkg, plan_json(pkg / "plan.json"), net


def _stages(pkg: Path) -> dict:
    """The package's stages in fp32 on the CPU, with the folder's weights (as --check)."""
    module = import_package(pkg)
    stages = {k: cls(device="cpu", dtype=torch.float32) for k, cls in module.STAGES.items()}
    for s in stages.values():
        s.eval()
    return stages


def _only(labels: torch.Tensor, row: int, a: int, b: int) -> torch.Tensor:
    """Labels of tokens a..b of `row` kept, every other ignored."""
    out = torch.full_like(labels, IGNORE)
    out[row, a:b] = labels[row, a:b]
    return out


def _alone(ids: torch.Tensor, labels: torch.Tensor, shape) -> dict:
    """One document unpacked in the package's shape: row 0 it and padding, the rest padding;
    positions as the runtime gives rows that are not packed."""
    batch = {
        "input_ids": torch.zeros(shape, dtype=torch.long),
        "labels": torch.full(shape, IGNORE, dtype=torch.long),
        "position_ids": torch.arange(shape[1]).expand(shape).clone(),
    }
    batch["input_ids"][0, : len(ids)] = ids
    batch["labels"][0, : len(ids)] = labels
    return batch


def test_the_package_takes_positions_and_passes_its_check(packed):
    _, pkg, plan, _ = packed
    assert list(plan["model"]["inputs"]) == ["input_ids", "position_ids", "labels"]
    assert check_package(pkg).ok  # its synthetic rows hold several documents each


@torch.no_grad()
def test_each_packed_document_loses_what_it_loses_alone(packed):
    root, pkg, plan, net = packed
    model = plan["model"]
    data = make_data(model, str(root / "train.jsonl"), 0, PACK, model["path"])
    stages = _stages(pkg)
    shape = model["inputs"]["input_ids"][0]
    worst = {"model": 0.0, "stages": 0.0, "stages alone": 0.0}
    crossing = 0.0  # positions running on, attention across documents: what --pack did before
    documents = 0
    for mb in range(2):
        batch = {n: data.get(n, mb) for n in model["inputs"]}
        for row, r in enumerate(data.rows(mb)):
            pos = data.row("position_ids", r)
            starts = [*(pos == 0).nonzero().flatten().tolist(), len(pos)]
            assert len(starts) > 2  # several documents in the row
            for a, b in zip(starts, starts[1:]):
                ids, labels = batch["input_ids"][row, a:b], batch["labels"][row, a:b]
                alone = float(net(input_ids=ids[None], labels=labels[None]).loss)
                one = {**batch, "labels": _only(batch["labels"], row, a, b)}
                in_model = float(loss_of(net, one))
                in_stages = float(run_in_one_process(stages, plan, one, backward=False))
                by_stages = _alone(ids, labels, shape)
                stages_alone = float(run_in_one_process(stages, plan, by_stages, backward=False))
                run_on = {k: v for k, v in one.items() if k != "position_ids"}
                for key, value in (("model", in_model), ("stages", in_stages),
                                   ("stages alone", stages_alone)):  # fmt: skip
                    worst[key] = max(worst[key], abs(value - alone))
                if a > 0:
                    crossing = max(crossing, abs(float(loss_of(net, run_on)) - alone))
                documents += 1
    print(f"{documents} documents: largest |packed - alone| {worst}; across documents {crossing}")
    assert documents >= 8
    assert all(v <= TOLERANCE for v in worst.values()), worst
    assert crossing > 1e-2  # so the test tells packing that keeps documents apart from the old


@pytest.mark.multiproc
@pytest.mark.slow
def test_two_ranks_train_on_packed_rows_as_one_process_does(packed):
    root, pkg, plan, net = packed
    argv = ["--data", "train.jsonl", "--pack", "--steps", str(STEPS), "--optimizer", "adamw",
            "--lr", str(LR), "--clip", str(CLIP), "--device", "cpu", "--init-method", f"file://{root / 'pack.store'}",
            "--log-json", "pack.json"]  # fmt: skip
    script = root / "job.py"
    script.write_text(
        "import runpy, sys\n"
        f"sys.argv = [{pkg.name!r}, *{argv!r}]\n"
        f"runpy.run_module({pkg.name!r}, run_name='__main__', alter_sys=True)\n"
    )
    path = os.pathsep.join([str(pkg.parent), RUNTIME_HOME, os.environ.get("PYTHONPATH", "")])
    env = {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           str(script)]  # fmt: skip
    proc = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    assert "compiled without --pack" not in proc.stderr
    log = json.loads((root / "pack.json").read_text())
    fresh = transformers.LlamaForCausalLM.from_pretrained(plan["model"]["path"])
    losses, _ = train_plain(plan, STEPS, "adamw", LR, CLIP, data=str(root / "train.jsonl"),
                            model=fresh, text=PACK)  # fmt: skip
    print(f"pipeline {log['losses']} one process {losses}")
    assert log["losses"] == pytest.approx(losses, rel=1e-4)
