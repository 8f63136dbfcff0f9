"""Frozen parameters and LoRA through the whole chain: compile, 2 CPU ranks, export, peft.

- Frozen prefix: a tiny untied Llama (4 layers) compiled with `--freeze` of the embedding and
  layers 0-2 under 1F1B; the plan has a forward-only stage. 5 steps on 2 ranks equal
  single-process training of the same frozen model (losses and trainable parameters, rtol
  1e-4); the frozen weights come out of --save-hf bit-identical to the folder's; the
  checkpoint holds no frozen weight and the forward-only stage no optimizer state.
- LoRA: the demo's tiny Llama (tied embeddings, a tokenizer) compiled with `--lora` under
  1F1B, 6 steps on question/answer text with an evaluation every 3 and `--save-hf
  --merge-lora`: losses and adapters
  equal single-process training of the peft-wrapped model (rtol 1e-4); peft's
  `PeftModel.from_pretrained` over the base folder loads the exported adapter and gives the
  pipeline's last evaluation loss (rtol 1e-4), and so does the merged folder.

Both trainings run in one `torchrun --nproc_per_node 2` (runpy), each with its own rendezvous.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from runtime_helpers import RUNTIME_HOME
from runtime_reference import train_plain
from text_helpers import eval_loss, pairs, write_jsonl

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
from click.testing import CliRunner  # noqa: E402
from demo_text import write_model  # noqa: E402
from ftpipe_runtime.data.batches import TextOptions  # noqa: E402
from ftpipe_runtime.models.lora import wrap  # noqa: E402
from ftpipe_runtime.spec.weights import initial_value  # noqa: E402
from runtime_helpers import plan_json  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

from ftpipe_compiler.cli import cli  # noqa: E402

pytestmark = [pytest.mark.multiproc, pytest.mark.slow]

STEPS, LR = 5, 0.01
FREEZE = r"model.embed_tokens|model.layers.[0-2]\."
LORA = "r=4,alpha=8,targets=q_proj,v_proj"
TRAIN = ["--schedule", "1f1b", "--optimizer", "adamw", "--lr", str(LR), "--device", "cpu"]
QA = ["--prompt-field", "question", "--target-field", "answer"]
TEXT = TextOptions(prompt_field="question", target_field="answer")


def _untied_llama(folder: Path) -> Path:
    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        tie_word_embeddings=False, attention_dropout=0.0,
    )  # fmt: skip
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(folder)
    return folder


def _compile(folder: Path, out: Path, *extra: str) -> Path:
    args = ["compile", "--model", str(folder), "--gpus", "2", "--seq-len", "16",
            "--micro-batch", "2", "--batch", "4", "--schedule", "1f1b", "-o", str(out), *extra]  # fmt: skip
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 0, result.output
    return out / f"{folder.name}_pipeline"


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("frozen")
    frozen = _compile(
        _untied_llama(root / "models" / "frozen"), root / "frozen", "--freeze", FREEZE
    )
    lora = _compile(write_model(root / "models" / "lora", "llama"), root / "lora", "--lora", LORA)
    write_jsonl(root / "train.jsonl", pairs(48, seed=0))
    write_jsonl(root / "val.jsonl", pairs(8, seed=1))
    jobs = {
        "frozen": (frozen.name, [*TRAIN, "--steps", str(STEPS), "--save-hf", "hf-frozen",
                                 "--save-every", str(STEPS), "--checkpoint-dir", "ck-frozen"]),
        "lora": (lora.name, [*TRAIN, "--steps", "6", "--data", "train.jsonl", "--eval-data",
                             "val.jsonl", *QA,
                             "--eval-every", "3", "--save-hf", "hf-lora", "--merge-lora"]),
    }  # fmt: skip
    script = root / "jobs.py"
    argvs = [(m, [*a, "--init-method", f"file://{root / (n + '.store')}", "--log-json",
                  f"{n}.json"]) for n, (m, a) in jobs.items()]  # fmt: skip
    script.write_text(
        "import json, runpy, sys\n"
        f"for module, argv in json.loads({json.dumps(json.dumps(argvs))}):\n"
        "    sys.argv = [module, *argv]\n"
        "    try:\n"
        "        runpy.run_module(module, run_name='__main__', alter_sys=True)\n"
        "    except SystemExit as e:\n"
        "        if e.code:\n"
        "            raise\n"
    )
    path = os.pathsep.join([str(frozen.parent), str(lora.parent), RUNTIME_HOME,
                            os.environ.get("PYTHONPATH", "")])  # fmt: skip
    env = {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           str(script)]  # fmt: skip
    proc = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    logs = {n: json.loads((root / f"{n}.json").read_text()) for n in jobs}
    return root, {"frozen": frozen, "lora": lora}, logs


def _plan(pkg: Path) -> dict:
    return plan_json(pkg / "plan.json")  # its model path resolved (relative to the package)


def _adapters_as_the_stages_start(net, plan: dict) -> None:
    """The stages start the adapters from `initial_value` (B at zero, as peft does)."""
    with torch.no_grad():
        for name, p in net.named_parameters():
            if p.requires_grad:
                p.copy_(initial_value(name, p.shape, p.dtype))


def test_a_frozen_prefix_trains_as_one_process_does(runs):
    root, pkgs, logs = runs
    plan = _plan(pkgs["frozen"])
    frozen = {p["name"] for p in plan["params"] if p["frozen"]}
    assert "model.embed_tokens.weight" in frozen and "model.layers.2.mlp.up_proj.weight" in frozen
    assert not any(n.startswith("model.layers.3.") for n in frozen)
    first = [s for s in plan["stages"] if s["forward_only"]]
    assert first and all(s["bwd_s"] == 0 and s["recompute_s"] == 0 for s in first)
    folder = Path(plan["model"]["path"])
    net = transformers.LlamaForCausalLM.from_pretrained(folder)
    for name, p in net.named_parameters():
        p.requires_grad_(name not in frozen)
    original = {n: t.clone() for n, t in net.state_dict().items()}
    losses, params = train_plain(plan, STEPS, "adamw", LR, model=net)
    assert logs["frozen"]["losses"] == pytest.approx(losses, rel=1e-4)
    out = load_file(str(root / "hf-frozen" / "model.safetensors"))
    for name in frozen:  # never touched: the very same bits
        assert torch.equal(out[name], original[name]), name
    trained = [n for n in params[-1] if n not in frozen]
    assert trained
    for name in trained:
        torch.testing.assert_close(out[name], params[-1][name], rtol=1e-4, atol=1e-6)
        assert not torch.equal(out[name], original[name]), name  # it did train
    step = root / "ck-frozen" / f"step-{STEPS:06d}"
    held = {k for f in step.glob("stage-*.safetensors") for k in load_file(str(f))}
    assert held and not held & frozen  # checkpoints keep what trains (and buffers)
    for s in first:
        assert not (step / f"stage-{s['id']}.optimizer.pt").exists()


def test_lora_trains_as_peft_does_and_peft_loads_the_adapter(runs):
    root, pkgs, logs = runs
    plan = _plan(pkgs["lora"])
    folder = Path(plan["model"]["path"])
    assert plan["model"]["lora"] == {"r": 4, "alpha": 8.0, "targets": ["q_proj", "v_proj"],
                                     "dropout": 0.0}  # fmt: skip
    trainable = {p["name"] for p in plan["params"] if p["trainable"]}
    assert trainable and all(".lora_" in n for n in trainable)
    net = wrap(transformers.LlamaForCausalLM.from_pretrained(folder), plan["model"]["lora"])
    _adapters_as_the_stages_start(net, plan)
    base = {n: t.clone() for n, t in net.named_parameters() if not t.requires_grad}
    losses, _ = train_plain(plan, 6, "adamw", LR, data=str(root / "train.jsonl"), model=net,
                            text=TEXT)  # fmt: skip
    assert logs["lora"]["losses"] == pytest.approx(losses, rel=1e-4)
    for n, t in net.named_parameters():
        if not t.requires_grad:
            assert torch.equal(t, base[n]), n
    # peft's own files, read by peft's own loader on the base model's folder
    assert {"adapter_config.json", "adapter_model.safetensors"} <= {
        p.name for p in (root / "hf-lora").iterdir()
    }
    ours = peft.get_peft_model_state_dict(net)
    saved = load_file(str(root / "hf-lora" / "adapter_model.safetensors"))
    assert set(saved) == set(ours)
    for k in ours:
        # AdamW's m / sqrt(v) turns gradients that differ in their last bits (the package's
        # fused LM head sums in its own order) into weights apart by ~1e-6 after 6 steps.
        torch.testing.assert_close(saved[k], ours[k], rtol=1e-4, atol=1e-5)
    assert any(".lora_B." in k and saved[k].abs().max() > 0 for k in saved)  # it trained
    loaded = peft.PeftModel.from_pretrained(
        transformers.LlamaForCausalLM.from_pretrained(folder), str(root / "hf-lora")
    ).eval()
    last = logs["lora"]["evals"][-1]
    assert last["step"] == 6
    assert eval_loss(loaded, plan, root / "val.jsonl", TEXT) == pytest.approx(
        last["loss"], rel=1e-4
    )
    merged = transformers.LlamaForCausalLM.from_pretrained(root / "hf-lora" / "merged").eval()
    assert eval_loss(merged, plan, root / "val.jsonl", TEXT) == pytest.approx(
        last["loss"], rel=1e-4
    )
