"""A real fine-tuning run: text in, evaluation through the pipeline, a HuggingFace folder out;
bf16 against single-process bf16 training; fp16's loss scaling skipping a step everywhere.

Tiny Llama (tied embeddings) and T5 folders with a tokenizer trained here (`text_helpers`),
a jsonl of question/answer pairs. Everything runs in one `torchrun --nproc_per_node 2`, each
job as `python -m <pkg>` runs it (runpy), with its own rendezvous:

- fp32, the plan's own (asynchronous) schedule: `--data train.jsonl --eval-data val.jsonl
  --eval-every 5 --steps 40 --save-hf out`. The evaluation loss falls; `from_pretrained(out)`
  loads with no missing or unexpected key, and its loss on the evaluation set (same batches,
  weighted by their samples) equals the pipeline's final evaluation loss (rtol 1e-4).
- bf16 (compiled with --dtype bf16), gpipe, 5 steps: the losses follow single-process
  training of the original model loaded in bf16 with the same recipe (fp32 master weights,
  gradients summed in fp32, AdamW on the masters, clipping by the global norm).
- fp16 (T5, gpipe, a checkpoint every step): an inf injected into one gradient of the second
  rank's stage at step 1 makes every rank skip that step: every stage's weights after step 2
  are those after step 1, and the loss scale halves.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from ftpipe_runtime.checkpoint.store import read_tensors, step_dir
from ftpipe_runtime.data.batches import TextOptions, make_data
from runtime_helpers import RUNTIME_HOME, plan_json
from runtime_reference import linear_lr, step_shares
from text_helpers import eval_loss, pairs, tiny_models, write_jsonl

transformers = pytest.importorskip("transformers")
pytest.importorskip("datasets")
from click.testing import CliRunner  # noqa: E402
from ftpipe_runtime.models.hf import loss_of  # noqa: E402

from ftpipe_compiler.cli import cli  # noqa: E402

pytestmark = [pytest.mark.multiproc, pytest.mark.slow]

QA = ["--prompt-field", "question", "--target-field", "answer"]
TEXT = TextOptions(prompt_field="question", target_field="answer")
FP32 = ["--steps", "40", "--eval-every", "5", "--optimizer", "adamw", "--lr", "3e-3"]
BF16_STEPS, LR, CLIP = 5, 1e-3, 1.0
BF16 = ["--schedule", "gpipe", "--steps", str(BF16_STEPS), "--optimizer", "adamw", "--lr",
        str(LR), "--clip", str(CLIP), "--decay", "linear"]  # fmt: skip


def _compile_copy(root: Path, model: str, name: str, dtype: str) -> Path:
    """A model folder compiled again under another package name (one interpreter runs all)."""
    copy = root / "models" / name
    shutil.copytree(root / "models" / model, copy)
    target = ["--target-len", "8"] if model == "t5" else []
    args = ["compile", "--model", str(copy), "--gpus", "2", "--seq-len", "16", "--micro-batch",
            "2", "--batch", "4", *target, "--dtype", dtype, "-o", str(root / name)]  # fmt: skip
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 0, result.output
    return root / name / f"{name}_pipeline"


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("finetune")
    pkgs = tiny_models(root)
    for name in ("llama", "t5"):
        pkgs[f"{name}_bf16"] = _compile_copy(root, name, f"{name}_bf16", "bf16")
    pkgs["t5_fp16"] = _compile_copy(root, "t5", "t5_fp16", "fp16")
    write_jsonl(root / "train.jsonl", pairs(64, seed=0))
    write_jsonl(root / "val.jsonl", pairs(16, seed=1))
    fp16_plan = json.loads((pkgs["t5_fp16"] / "plan.json").read_text())
    inject = max(s["id"] for s in fp16_plan["stages"] if s["gpu"] == 1)
    fp16 = [
        "--schedule",
        "gpipe",
        "--decay",
        "constant",
        "--save-every",
        "1",
        "--keep-checkpoints",
        "0",
    ]
    poison = {"FTPIPE_INJECT_INF": f"{inject}:1"}
    jobs = {  # name: (package, arguments, environment)
        "llama": ("llama", [*FP32, "--save-hf", "hf-llama", "--log-dir", "logs-llama",
                            "--save-every", "20", "--checkpoint-dir", "ck-llama",
                            "--save-hf-every-checkpoint"], {}),
        "t5": ("t5", [*FP32, "--save-hf", "hf-t5"], {}),
        "llama_bf16": ("llama_bf16", BF16, {}),
        "t5_bf16": ("t5_bf16", BF16, {}),
        "llama_bf16_pure": ("llama_bf16", [*BF16, "--dtype", "bf16-pure"], {}),
        "t5_fp16": ("t5_fp16", [*fp16, "--steps", "3", "--checkpoint-dir", "ck-fp16"], poison),
        "t5_fp16_resumed": ("t5_fp16", [*fp16, "--steps", "4", "--checkpoint-dir", "ck-fp16",
                                        "--resume"], poison),
        "t5_fp16_whole": ("t5_fp16", [*fp16, "--steps", "4", "--checkpoint-dir", "ck-whole"],
                          poison),
    }  # fmt: skip
    argvs = []
    for name, (pkg, argv, env) in jobs.items():
        data = ["--data", "train.jsonl"] + (
            ["--eval-data", "val.jsonl"] if "--eval-every" in argv else []
        )
        argvs.append((pkgs[pkg].name, [*data, *QA, *argv, "--device", "cpu", "--init-method",
                      f"file://{root / (name + '.store')}", "--log-json", f"{name}.json"], env))  # fmt: skip
    proc = _torchrun(root, pkgs, argvs)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    logs = {name: json.loads((root / f"{name}.json").read_text()) for name in jobs}
    return root, pkgs, logs, proc.stderr


def _torchrun(cwd: Path, pkgs: dict, argvs: list) -> subprocess.CompletedProcess:
    script = cwd / "jobs.py"
    script.write_text(
        "import json, os, runpy, sys\n"
        f"for module, argv, env in json.loads({json.dumps(json.dumps(argvs))}):\n"
        "    os.environ.update(env)\n"
        "    sys.argv = [module, *argv]\n"
        "    try:\n"
        "        runpy.run_module(module, run_name='__main__', alter_sys=True)\n"
        "    except SystemExit as e:\n"
        "        if e.code:\n"
        "            raise\n"
        "    for key in env:\n"
        "        del os.environ[key]\n"
    )
    found = sorted({str(p.parent) for p in pkgs.values()})
    path = os.pathsep.join([*found, RUNTIME_HOME, os.environ.get("PYTHONPATH", "")])
    env = {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           str(script)]  # fmt: skip
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=900)


def _plan(pkg: Path) -> dict:
    return plan_json(pkg / "plan.json")  # its model path resolved (relative to the package)


@pytest.mark.parametrize("name", ["llama", "t5"])
def test_text_fine_tuning_evaluates_and_saves_a_huggingface_folder(runs, name):
    root, pkgs, logs, _ = runs
    evals = logs[name]["evals"]
    assert [e["step"] for e in evals] == [5, 10, 15, 20, 25, 30, 35, 40]
    assert evals[-1]["loss"] < 0.8 * evals[0]["loss"], evals  # it learns
    assert evals[-1]["perplexity"] == pytest.approx(torch.tensor(evals[-1]["loss"]).exp().item())
    assert evals[-1]["samples"] == 16
    plan = _plan(pkgs[name])
    cls = getattr(transformers, plan["model"]["hf_class"])
    net, info = cls.from_pretrained(str(root / f"hf-{name}"), output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    net.eval()
    assert eval_loss(net, plan, root / "val.jsonl", TEXT) == pytest.approx(
        evals[-1]["loss"], rel=1e-4
    )
    tok = transformers.AutoTokenizer.from_pretrained(str(root / f"hf-{name}"))
    assert tok.eos_token_id == 3


def test_the_run_log_has_every_step_and_evaluation(runs):
    root, _, logs, _ = runs
    lines = [json.loads(x) for x in (root / "logs-llama" / "log.jsonl").read_text().splitlines()]
    train = [x for x in lines if x["kind"] == "train"]
    evals = [x for x in lines if x["kind"] == "eval"]
    assert [x["step"] for x in train] == list(range(1, 41))
    assert [x["loss"] for x in train] == pytest.approx(logs["llama"]["losses"])
    assert [x["loss"] for x in evals] == [e["loss"] for e in logs["llama"]["evals"]]
    assert all(x["lr"] > 0 and x["samples_per_s"] > 0 for x in train)
    assert sorted(p.name for p in (root / "logs-llama" / "tensorboard").iterdir()) == [
        "rank-0",
        "rank-1",
    ]


def _reference(pkg: Path, steps: int, dtype: torch.dtype, masters: bool = True) -> list[float]:
    """The original model loaded in `dtype`, trained in one process with the pipeline's
    recipe: fp32 masters and gradient sums, AdamW on the masters, global-norm clipping
    (`masters=False`: AdamW on the weights themselves, bf16-pure); the step's loss its label
    tokens' mean, the Trainer's AdamW defaults (no weight decay)."""
    plan = _plan(pkg)
    model = plan["model"]
    cls = getattr(transformers, model["hf_class"])
    net = cls.from_pretrained(model["path"], dtype=dtype).train()
    params = [p for p in net.parameters() if p.requires_grad]
    kept = [p.detach().float().requires_grad_(True) for p in params] if masters else params
    opt = torch.optim.AdamW(kept, lr=LR, weight_decay=0.0)
    data = make_data(model, "train.jsonl", 0, TEXT, model["path"])
    losses = []
    for k in range(steps):
        total = 0.0
        for mb, share in step_shares(plan, data, k).items():
            loss = loss_of(net, {n: data.get(n, mb) for n in model["inputs"]})
            (loss * share).backward()
            total += loss.item() * share
            for p, w in zip(params, kept):
                if p.grad is not None and w is not p:
                    w.grad = p.grad.float() if w.grad is None else w.grad + p.grad.float()
                    p.grad = None
        losses.append(total)
        torch.nn.utils.clip_grad_norm_(kept, CLIP)
        for group in opt.param_groups:
            group["lr"] = linear_lr(k, LR, steps)
        opt.step()
        opt.zero_grad()
        with torch.no_grad():
            for p, w in zip(params, kept):
                p.copy_(w)
    return losses


@pytest.mark.parametrize("name", ["llama", "t5"])
def test_bf16_follows_single_process_bf16_training(runs, name, monkeypatch):
    root, pkgs, logs, _ = runs
    monkeypatch.chdir(root)
    log = logs[f"{name}_bf16"]
    assert log["dtype"] == "bf16"
    reference = _reference(pkgs[f"{name}_bf16"], BF16_STEPS, torch.bfloat16)
    assert log["losses"] == pytest.approx(reference, rel=1e-2)  # bf16: 8 bits of mantissa
    # ... and it is bf16 training: fp32 training of the same recipe is further away.
    fp32 = _reference(pkgs[f"{name}_bf16"], BF16_STEPS, torch.float32)
    off = [abs(a - b) for a, b in zip(log["losses"], reference)]
    # T5's loss is computed in bf16 (its logits are not upcast): a logged loss moves in whole
    # bf16 steps (1/128 at 4), and one micro-batch's loss a step away is 0.008 of the 0.08 the
    # fp32 run is off over 5 steps; so T5 is only asked to be closer (measured: 0.047 against
    # 0.083; with the reference of before the Trainer's rule 0.039 against 0.086).
    factor = 1.0 if name == "t5" else 0.5
    assert sum(off) < factor * sum(abs(a - b) for a, b in zip(log["losses"], fp32)), (off, fp32)


def test_bf16_pure_steps_the_bf16_weights_themselves(runs, monkeypatch):
    """--dtype bf16-pure: no master copy; AdamW on the bf16 weights (its state in bf16)."""
    root, pkgs, logs, _ = runs
    monkeypatch.chdir(root)
    log = logs["llama_bf16_pure"]
    reference = _reference(pkgs["llama_bf16"], BF16_STEPS, torch.bfloat16, masters=False)
    assert log["dtype"] == "bf16-pure" and log["losses"] == pytest.approx(reference, rel=1e-2)
    assert log["losses"] != logs["llama_bf16"]["losses"]  # another recipe


def test_fp16_overflow_on_one_stage_is_skipped_by_every_stage(runs):
    root, pkgs, logs, stderr = runs
    plan = _plan(pkgs["t5_fp16"])
    assert logs["t5_fp16"]["skipped_steps"] == [[1], [1]]  # both ranks skipped step 1
    assert "step 2: the gradients overflowed in fp16" in stderr
    ck = root / "ck-fp16"
    for s in plan["stages"]:
        after = [read_tensors(step_dir(ck, k) / f"stage-{s['id']}.safetensors") for k in (1, 2, 3)]
        assert all(torch.equal(after[0][n], after[1][n]) for n in after[0])  # step 2 skipped
        assert any(not torch.equal(after[1][n], after[2][n]) for n in after[1])  # 3 stepped
    scales = [
        json.loads((step_dir(ck, k) / "rank-0.json").read_text())["state"]["loss_scale"]["scale"]
        for k in (1, 2, 3)
    ]
    assert scales == [2.0**16, 2.0**15, 2.0**15]


@pytest.mark.parametrize("name", ["llama_bf16", "t5_bf16"])
def test_a_bf16_package_runs_its_own_code_in_fp32_exactly(runs, name):
    """Traced in bf16, the casts to bf16 follow the stage's dtype: run in fp32 (`--check`),
    the stages give the original fp32 model's loss and gradients, to the rounding of the
    fused LM head's own order of sums (~1e-7 relative; a cast left at bf16 costs ~1e-3)."""
    from ftpipe_compiler.codegen import check_package

    _, pkgs, _, _ = runs
    code = (pkgs[name] / "stages.py").read_text()
    assert 'TRACED_DTYPE = "bfloat16"' in code and "self.compute_dtype" in code
    result = check_package(pkgs[name])
    assert result.ok and result.loss_rel_diff <= 1e-6 and result.grad_max_rel_diff <= 1e-5


def test_fp16_resumes_exactly_with_its_masters_and_loss_scale(runs):
    """Resumed at step 3 (fp32 masters and the halved loss scale from the checkpoint), step 4
    gives the weights of an uninterrupted run bit for bit."""
    root, pkgs, logs, _ = runs
    assert logs["t5_fp16_resumed"]["first_step"] == 3
    assert logs["t5_fp16_whole"]["skipped_steps"] == [[1], [1]]
    for s in _plan(pkgs["t5_fp16"])["stages"]:
        name = f"stage-{s['id']}.safetensors"
        resumed = read_tensors(step_dir(root / "ck-fp16", 4) / name)
        whole = read_tensors(step_dir(root / "ck-whole", 4) / name)
        assert resumed.keys() == whole.keys()
        assert all(torch.equal(resumed[n], whole[n]) for n in whole)
        queries = [v for n, v in whole.items() if n.endswith(".q.weight")]  # fp16 weights:
        assert all(v.dtype == torch.float32 for v in queries)  # saved as their fp32 masters
    state = json.loads((step_dir(root / "ck-fp16", 4) / "rank-1.json").read_text())["state"]
    assert state["loss_scale"]["scale"] == 2.0**15


def test_each_checkpoint_becomes_a_huggingface_folder(runs):
    root, pkgs, _, _ = runs
    plan = _plan(pkgs["llama"])
    cls = getattr(transformers, plan["model"]["hf_class"])
    assert (root / "hf-llama-step-000020" / "config.json").is_file()
    final = cls.from_pretrained(str(root / "hf-llama")).state_dict()
    last, info = cls.from_pretrained(str(root / "hf-llama-step-000040"), output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert all(torch.equal(v, final[k]) for k, v in last.state_dict().items())
