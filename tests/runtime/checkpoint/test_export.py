"""A HuggingFace folder from the stages' tensors: what `from_pretrained` loads, whole.

The stages of tiny Llama (tied embeddings) and T5 packages stand in for a trained pipeline;
their tensors, written by `write_hf_folder` or exported from a checkpoint with the package's
`export` command, must load with no missing or unexpected key and give the stages' loss.
"""

from __future__ import annotations

import json

import pytest
import torch
from ftpipe_runtime.checkpoint.hf import write_hf_folder
from ftpipe_runtime.checkpoint.store import Checkpoints, plan_hash, step_dir
from ftpipe_runtime.job import cli
from ftpipe_runtime.job.check import synthetic_inputs
from ftpipe_runtime.stage.api import run_in_one_process
from text_helpers import tiny_models
from tiny_disk import fill, snapshot

transformers = pytest.importorskip("transformers")
from ftpipe_compiler.codegen import import_package  # noqa: E402


@pytest.fixture(scope="module")
def packages(tmp_path_factory):
    return tiny_models(tmp_path_factory.mktemp("export"))


def _stages(pkg, seed: int):
    """The package's stages with weights nobody else has (as after training)."""
    mod = import_package(pkg)
    stages = {k: cls(device="cpu") for k, cls in mod.STAGES.items()}
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for s in stages.values():
            for p in s.parameters():
                p.add_(torch.randn(p.shape, generator=gen) * 0.01)
            s.eval()
    return mod, stages


def _loaded(out, plan):
    cls = getattr(transformers, plan["model"]["hf_class"])
    net, info = cls.from_pretrained(str(out), output_loading_info=True)
    return net.eval(), info


@pytest.mark.parametrize("name", ["llama", "t5"])
def test_the_folder_loads_whole_and_computes_the_stages_loss(packages, name, tmp_path):
    mod, stages = _stages(packages[name], seed=1)
    plan = mod.load_plan()
    tensors = {k: v for s in stages.values() for k, v in s.state_dict().items()}
    out = tmp_path / "hf"
    write_hf_folder(out, plan, tensors, max_shard_size="40KB")
    net, info = _loaded(out, plan)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    inputs = synthetic_inputs(plan)
    want = run_in_one_process(stages, plan, inputs, backward=False)
    got = net(**inputs, use_cache=False).loss
    assert got.item() == pytest.approx(want.item(), rel=1e-6)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = set(index["weight_map"].values())
    assert len(shards) > 1 and all((out / f).is_file() for f in shards)  # sharded, indexed
    tied = {"llama": ("model.embed_tokens.weight", "lm_head.weight"), "t5": ("shared.weight",
            "lm_head.weight")}[name]  # fmt: skip
    assert tied[0] in index["weight_map"] and tied[1] not in index["weight_map"]  # once
    tok = transformers.AutoTokenizer.from_pretrained(str(out))  # copied beside the weights
    assert tok("one two")["input_ids"][:3] == ([2, 5, 6] if name == "llama" else [5, 6, 3])


def _checkpoint(root, plan, stages):
    """The stages saved as step 3 of a checkpoint folder, every rank's part."""
    for rank in range(plan["gpus"]):
        ckpt = Checkpoints(root, rank, plan["gpus"], {"plan": plan_hash(plan)})
        for s in plan["stages"]:
            if s["gpu"] == rank:
                ckpt.save_stage(3, s["id"], stages[s["id"]], None)
        ckpt.finish_rank(3, next_micro_batch=6)
    return root


def test_export_writes_a_checkpoint_as_a_folder(packages, tmp_path, capsys):
    pkg = packages["llama"]
    mod, stages = _stages(pkg, seed=2)
    plan = mod.load_plan()
    root = _checkpoint(tmp_path / "ckpt", plan, stages)
    argv = ["export", "--checkpoint-dir", str(root), "-o", str(tmp_path / "hf")]
    assert cli.main(argv, mod.STAGES, pkg / "plan.json", pkg.name) == 0
    assert "wrote" in capsys.readouterr().out
    net, info = _loaded(tmp_path / "hf", plan)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    inputs = synthetic_inputs(plan)
    want = run_in_one_process(stages, plan, inputs, backward=False).item()
    assert net(**inputs, use_cache=False).loss.item() == pytest.approx(want, rel=1e-6)

    # Bad requests: one sentence, exit 1, nothing written.
    before = sorted(p.name for p in tmp_path.iterdir())
    cases = [
        (["--step", "7"], "has no complete checkpoint of step 7; it has \\[3\\]"),
        (["--checkpoint-dir", str(tmp_path / "none")], "holds no complete checkpoint"),
    ]
    for extra, message in cases:
        rc = cli.main([*argv[:3], "-o", str(tmp_path / "again"), *extra], mod.STAGES,
                      pkg / "plan.json", pkg.name)  # fmt: skip
        err = capsys.readouterr().err
        assert rc == 1 and err.count("\n") == 1 and "Traceback" not in err, err
        assert __import__("re").search(message, err), err
    shard = step_dir(root, 3) / "stage-1.safetensors"
    shard.write_bytes(shard.read_bytes()[:-8] + b"\0" * 8)
    rc = cli.main([*argv[:3], "-o", str(tmp_path / "again")], mod.STAGES, pkg / "plan.json", "p")
    err = capsys.readouterr().err
    assert rc == 1 and "step-000003 is damaged (stage-1.safetensors has changed" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == before


def test_a_full_disk_during_export_keeps_the_previous_folder(packages, tmp_path, tiny_disk, capsys):
    """safetensors says a full disk with its own error (no OSError): still one sentence, exit
    1, the half-written folder gone and the previous export byte-identical."""
    pkg = packages["llama"]
    mod, stages = _stages(pkg, seed=3)
    root = _checkpoint(tmp_path / "ckpt", mod.load_plan(), stages)
    disk = tiny_disk()
    out = disk / "hf"
    argv = ["export", "--checkpoint-dir", str(root), "-o", str(out)]
    assert cli.main(argv, mod.STAGES, pkg / "plan.json", pkg.name) == 0
    before = snapshot(disk)
    fill(disk)
    capsys.readouterr()
    assert cli.main(argv, mod.STAGES, pkg / "plan.json", pkg.name) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert err.startswith(f"ftpipe: cannot write {out}: No space left on device (0.0 B free there")
    assert err.endswith(" needed); free some space or write elsewhere; nothing changed\n"), err
    assert snapshot(disk) == before
    assert sorted(p.name for p in disk.iterdir()) == ["ballast", "hf"]
