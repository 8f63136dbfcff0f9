"""Families that once needed code of their own compile with none: a constant the forward
makes from Python data (Falcon's multi-query attention indexes with a list), a sequence
classifier whose config names no problem_type (DeBERTa-v2 then branches on the labels'
values), and a mixture of experts whose checkpoint stores its experts apart and whose routing
counts tokens with `torch.histc` on integers on a GPU, on floats on the CPU (Mixtral). Each
tiny model is written with save_pretrained, compiled, and its package checked against the
model."""

from __future__ import annotations

import pytest
import torch
from click.testing import CliRunner
from torch import nn

from ftpipe_compiler.cli import cli
from ftpipe_compiler.codegen import check_package
from ftpipe_compiler.graph.trace import _ConstantsOnCpu
from ftpipe_compiler.plan import Plan

transformers = pytest.importorskip("transformers")


class ListIndexed(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(4, 6)

    def forward(self, x):
        y = self.proj(x).view(2, 3, 2)
        scale = torch.tensor([0.5, 2.0], device=x.device)  # made from data on the input's device
        return (y[..., [1], :].sum() + (y[:, [-1, 0]] * scale).mean()).float()


def test_constants_made_from_data_keep_their_values():
    """Traced on meta, the index lists and the tensor made from data are constants with their
    values (made on the CPU); without the mode they are meta tensors, their values lost."""
    with torch.device("meta"):
        model = ListIndexed()
    x = torch.randn(2, 4, device="meta")
    lost = torch.export.export(model, (x,), strict=False).constants
    assert {t.device.type for t in lost.values()} == {"meta"}
    with _ConstantsOnCpu():
        kept = torch.export.export(model, (x,), strict=False).constants
    values = sorted(t.tolist() for t in kept.values())
    assert values == [[-1, 0], [0.5, 2.0], [1]]
    assert {t.device.type for t in kept.values()} == {"cpu"}


def _compile_and_check(folder, tmp_path) -> Plan:
    out = tmp_path / "out"
    r = CliRunner().invoke(cli, ["compile", "--model", str(folder), "--gpus", "2",
                                 "--seq-len", "16", "-p", "even-layers", "-o", str(out)])  # fmt: skip
    assert r.exit_code == 0, r.output
    result = check_package(out / f"{folder.name}_pipeline")
    assert result.ok and result.loss_rel_diff <= 1e-5, result
    return Plan.load(out / "plan.json")


def test_falcon_multi_query_compiles(tmp_path):
    torch.manual_seed(0)
    config = transformers.FalconConfig(vocab_size=128, hidden_size=32, num_hidden_layers=2,
                                       num_attention_heads=4, multi_query=True, bias=False,
                                       new_decoder_architecture=False, parallel_attn=True,
                                       max_position_embeddings=64)  # fmt: skip
    config.architectures = ["FalconForCausalLM"]
    transformers.FalconForCausalLM(config).save_pretrained(tmp_path / "falcon")
    _compile_and_check(tmp_path / "falcon", tmp_path)


@pytest.mark.parametrize(("labels", "implied"), [(3, "single_label_classification"),
                                                 (1, "regression")])  # fmt: skip
def test_a_classifier_without_problem_type_gets_its_heads(tmp_path, labels, implied):
    torch.manual_seed(0)
    config = transformers.DebertaV2Config(hidden_size=32, num_hidden_layers=2,
                                          num_attention_heads=2, intermediate_size=64,
                                          vocab_size=128, max_position_embeddings=64,
                                          num_labels=labels)  # fmt: skip
    config.architectures = ["DebertaV2ForSequenceClassification"]
    assert config.problem_type is None
    transformers.DebertaV2ForSequenceClassification(config).save_pretrained(tmp_path / "deberta")
    plan = _compile_and_check(tmp_path / "deberta", tmp_path)
    assert plan.model["config"]["problem_type"] == implied


def test_mixture_of_experts_loads_its_experts_and_runs_where_it_was_not_traced(tmp_path):
    """Mixtral's checkpoint stores each expert's matrices apart, which transformers fuses as
    it loads: the stages fuse them the same way (`converted_from_folder`). Traced on meta,
    transformers' grouped experts take the GPU's branch (`histc` of integers, which the CPU
    kernel refuses); the trace counts on floats, so the package runs on the CPU too, its
    loss and gradients the model's (the reference loaded by `from_pretrained`). Exported,
    the stages' tensors load back into the model as the checkpoint's did."""
    torch.manual_seed(0)
    config = transformers.MixtralConfig(vocab_size=128, hidden_size=32, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2,
                                        intermediate_size=64, num_local_experts=4,
                                        num_experts_per_tok=2, max_position_embeddings=64)  # fmt: skip
    config.architectures = ["MixtralForCausalLM"]
    transformers.MixtralForCausalLM(config).save_pretrained(tmp_path / "mixtral")
    plan = _compile_and_check(tmp_path / "mixtral", tmp_path)
    assert "model.layers.1.mlp.experts.gate_up_proj" in {p.name for p in plan.params}
    stages = (tmp_path / "out" / "mixtral_pipeline" / "stages.py").read_text()
    assert "aten.histc.default" in stages  # the routing counts are in the graph, portable
    assert 'import_ops(["transformers.integrations.moe"])' in stages  # its custom op's home
    # The stages' tensors back as a HuggingFace folder: the experts stored apart again.
    from ftpipe_runtime.checkpoint.hf import write_hf_folder
    from ftpipe_runtime.stage.package import import_package

    module = import_package(tmp_path / "out" / "mixtral_pipeline")
    tensors = {n: t for cls in module.STAGES.values() for n, t in cls().named_tensors().items()}
    write_hf_folder(tmp_path / "export", module.load_plan(), tensors, say=lambda *a: None)
    again = transformers.MixtralForCausalLM.from_pretrained(tmp_path / "export")
    first = transformers.MixtralForCausalLM.from_pretrained(tmp_path / "mixtral")
    mine, theirs = dict(again.named_parameters()), dict(first.named_parameters())
    assert mine.keys() == theirs.keys() and all(torch.equal(mine[n], theirs[n]) for n in mine)
