"""Freeze training in the runtime (PipeTransformer §3.1): a 4-layer BERT on 2 CPU ranks.

Forced (`--freeze-at`), the run equals one process that freezes the same layers after the
same step (losses, and every weight after the freeze; SGD: BERT-QA has weights whose
gradient is 0 in exact arithmetic, the QA bias among them, and Adam would turn two runs'
different rounding noise there into different steps of +-lr); under the rule (`--freeze-alpha`),
the pipeline's per-layer gradient norms equal the single process's and its decision is eq. 1
applied to them; each decision is in the run log and the summary.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from runtime_reference import checkpoint_params, linear_lr, reference_optimizer, step_shares
from safetensors.torch import load_file

transformers = pytest.importorskip("transformers")
from ftpipe_runtime.data.batches import make_data  # noqa: E402
from ftpipe_runtime.freeze.layers import layer_units, next_frozen  # noqa: E402
from ftpipe_runtime.models import with_dropout  # noqa: E402
from ftpipe_runtime.models.hf import build_model  # noqa: E402
from ftpipe_runtime.models.hf import loss_of as hf_loss  # noqa: E402
from runtime_helpers import plan_json  # noqa: E402

from ftpipe_compiler.cli import cli  # noqa: E402

pytestmark = pytest.mark.multiproc

STEPS, LR, CLIP = 4, 0.05, 1.0
BERT = dict(
    hidden_size=32, num_hidden_layers=4, num_attention_heads=4, intermediate_size=64,
    vocab_size=128, max_position_embeddings=64,
)  # fmt: skip


def write_bert(folder: Path) -> None:
    """The tiny QA BERT these tests compile, dropout off, seed 0, as a HuggingFace folder."""
    config = transformers.AutoConfig.for_model("bert", **BERT)
    for key, value in with_dropout(config.to_dict(), 0.0).items():
        setattr(config, key, value)
    torch.manual_seed(0)
    transformers.BertForQuestionAnswering(config).save_pretrained(folder)


@pytest.fixture(scope="module")
def package(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("freeze")
    write_bert(root / "bert")
    args = ["compile", "--model", str(root / "bert"), "--gpus", "2", "--seq-len", "16",
            "--micro-batch", "2", "--batch", "4", "-o", str(root / "out")]  # fmt: skip
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 0, result.output
    return root / "out" / "bert_pipeline"


def _train_frozen(plan: dict, optimizer: str, freeze_after: int, layers: int | None, alpha=None):
    """The HF model in one process, as the runtime trains it; after `freeze_after` steps the
    bottom `layers` (None: eq. 1 on this step's norms) stop training. Returns the losses,
    the weights after every step, and the per-layer gradient norms at the decision."""
    model = plan["model"]
    net = build_model(model["config"], model["hf_class"], "cpu", dropout=0.0)
    net.load_state_dict(load_file(str(Path(model["path"]) / "model.safetensors")), strict=False)
    opt = reference_optimizer(optimizer, net.parameters(), LR)
    units = layer_units([p["name"] for p in plan["params"]])
    named = dict(net.named_parameters())
    source = make_data(model, None, 0)
    losses, params, norms = [], [], None
    for k in range(STEPS):
        total = 0.0
        for mb, share in step_shares(plan, source, k).items():
            loss = hf_loss(net, {n: source.get(n, mb) for n in model["inputs"]})
            (loss * share).backward()
            total += loss.item() * share
        losses.append(total)
        decide = k + 1 == freeze_after
        if decide:
            norms = [
                sum(
                    named[n].grad.double().pow(2).sum()
                    for n in u
                    if n in named and named[n].grad is not None
                )
                ** 0.5
                for u in units
            ]
            norms = [float(x) for x in norms]
        torch.nn.utils.clip_grad_norm_(net.parameters(), CLIP)
        for group in opt.param_groups:
            group["lr"] = linear_lr(k, LR, STEPS)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if decide:
            layers = layers if layers is not None else next_frozen(0, norms, alpha)
            frozen = {named[n] for u in units[:layers] for n in u if n in named}
            for p in frozen:
                p.requires_grad_(False)
                opt.state.pop(p, None)
            for group in opt.param_groups:
                group["params"] = [p for p in group["params"] if p not in frozen]
        params.append({n: p.detach().clone() for n, p in net.named_parameters()})
    return losses, params, norms, layers


def _run(run_pipeline, package, tmp_path, name, optimizer, extra):
    plan = plan_json(package / "plan.json")
    ckpt, log = tmp_path / f"{name}-ckpt", tmp_path / f"{name}.json"
    argv = ["--steps", str(STEPS), "--optimizer", optimizer, "--lr", str(LR), "--clip", str(CLIP),
            "--schedule", "gpipe", "--device", "cpu", "--save-every", "2",
            "--checkpoint-dir", str(ckpt), "--log-json", str(log),
            "--log-dir", str(tmp_path / f"{name}-log"), *extra]  # fmt: skip
    env = {"PYTHONPATH": os.pathsep.join([str(package.parent), os.environ.get("PYTHONPATH", "")])}
    codes, ranks = run_pipeline(plan, argv, name=name, module=package.name, cwd=package.parent,
                                env=env)  # fmt: skip
    assert codes == [0] * plan["gpus"], ranks.stderr()
    stages = range(len(plan["stages"]))
    lines = (tmp_path / f"{name}-log" / "log.jsonl").read_text().splitlines()
    logged = [json.loads(x) for x in lines if json.loads(x)["kind"] == "freeze"]
    return plan, json.loads(log.read_text()), ckpt, stages, logged


def test_forced_freeze_equals_one_process_freezing_alike(run_pipeline, package, tmp_path):
    plan, got, ckpt, stages, logged = _run(
        run_pipeline, package, tmp_path, "forced", "sgd", ["--freeze-at", "2:2"]
    )
    losses, params, _, _ = _train_frozen(plan, "sgd", freeze_after=2, layers=2)
    assert got["losses"] == pytest.approx(losses, rel=1e-5)
    assert [(f["step"], f["frozen"], f["by"]) for f in got["freezes"]] == [(2, 2, "forced")]
    assert [(f["step"], f["frozen"]) for f in logged] == [(2, 2)]
    units = layer_units([p["name"] for p in plan["params"]])
    frozen = {n for u in units[:2] for n in u}
    assert any(n.startswith("bert.embeddings") for n in frozen)
    at2, at4 = checkpoint_params(ckpt, 2, stages), checkpoint_params(ckpt, 4, stages)
    for name, value in params[-1].items():
        torch.testing.assert_close(at4[name], value, rtol=1e-5, atol=1e-6, msg=name)
        if name in frozen:  # not touched after the freeze
            assert torch.equal(at4[name], at2[name]), name
        else:
            assert not torch.equal(at4[name], at2[name]), name


def test_rule_decides_on_the_pipelines_gradient_norms(run_pipeline, package, tmp_path):
    alpha = 0.5
    plan, got, _, _, logged = _run(
        run_pipeline, package, tmp_path, "rule", "adamw",
        ["--freeze-alpha", str(alpha), "--freeze-every", "2"],
    )  # fmt: skip
    losses, _, norms, layers = _train_frozen(plan, "adamw", 2, layers=None, alpha=alpha)
    first = logged[0]
    assert (first["step"], first["by"], first["bound"]) == (2, "rule", 2)  # 0 + 4 / 2
    assert first["norms"] == pytest.approx(norms, rel=1e-4)
    assert first["frozen"] == layers == next_frozen(0, first["norms"], alpha)
    assert got["losses"] == pytest.approx(losses, rel=1e-5)
    assert [f["step"] for f in got["freezes"]] == [2, 4]
