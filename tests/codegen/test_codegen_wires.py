"""What crosses between stages: tuples, in-place updates, masks, several values of one layer."""

from __future__ import annotations

import json
from collections import Counter

import pytest
from codegen_helpers import contiguous, costed, plan_from_cuts

from ftpipe_compiler.codegen import check_package, generate_package, import_package
from ftpipe_compiler.codegen.names import abbreviate


def _cut_before(graph, node_id):
    return plan_from_cuts(graph, [graph.index[node_id]])


def _generate(model, plan, tmp_path, granularity="op"):
    spec, _, traced, graph = costed(model, granularity)
    pkg = generate_package(traced, graph, plan, spec, tmp_path, command="pytest")
    return pkg, json.loads((pkg / "plan.json").read_text())


def test_tuple_elements_cross_not_tuples(tmp_path):
    """GPT-2 splits q, k, v out of one tensor; cut between the split and its getitems."""
    graph = costed("gpt2-tiny")[3]
    split = next(n for n in graph.nodes if n.op == "aten.split.Tensor")
    plan = plan_from_cuts(graph, [graph.index[split.id] + 1])
    assert any(t.tensor == split.id for t in plan.transfers)  # the plan sends the tuple...
    pkg, data = _generate("gpt2-tiny", plan, tmp_path)
    sent = {t["tensor"] for t in data["transfers"]}
    assert split.id not in sent  # ...the package sends its elements
    assert {f"getitem{s}" for s in ("", "_1", "_2")} <= sent
    assert check_package(pkg).ok


def test_in_place_op_on_a_received_tensor_works_on_a_copy(tmp_path):
    graph = costed("t5-tiny")[3]
    inplace = next(n for n in graph.nodes if n.op == "aten.add_.Tensor")
    target = graph.preds[inplace.id][0]
    plan = _cut_before(graph, inplace.id)
    pkg, data = _generate("t5-tiny", plan, tmp_path)
    assert target in {t["tensor"] for t in data["transfers"]}
    assert ".clone()" in (pkg / "stages.py").read_text()
    mod = import_package(pkg)
    first, second = mod.STAGES[0](), mod.STAGES[1]()
    inputs = {n: t for n, t in _inputs(mod, data).items()}
    out = first(**{n: inputs[n] for n in first.INPUTS})
    before = out[target].clone()
    second(**{n: inputs.get(n, out.get(n)) for n in second.INPUTS})
    assert out[target].equal(before)  # the sender's tensor is untouched
    assert check_package(pkg).ok


def _inputs(mod, data):
    from ftpipe_runtime.job.check import synthetic_inputs

    return synthetic_inputs(data)


def test_masks_cross_as_integer_or_bool_tensors_without_gradient(tmp_path):
    graph = costed("t5-tiny")[3]
    pkg, data = _generate("t5-tiny", contiguous(graph, 3), tmp_path)
    dtypes = {t["dtype"] for t in data["transfers"]}
    assert "bool" in dtypes or "int64" in dtypes
    for t in data["transfers"]:
        if not t["dtype"].startswith("float"):
            assert not t["requires_grad"]
    assert any(t["requires_grad"] for t in data["transfers"])


def test_a_layer_node_may_send_several_values(tmp_path):
    """At layer granularity T5's block 0 sends the hidden state and the position bias."""
    graph = costed("t5-tiny", "layer")[3]
    plan = contiguous(graph, 3, gpus=2)
    pkg, data = _generate("t5-tiny", plan, tmp_path, "layer")
    per_node = Counter(data["wires"].values())
    assert max(per_node.values()) >= 2
    assert set(data["wires"].values()) <= {t.tensor for t in plan.transfers}
    assert check_package(pkg).ok


@pytest.mark.parametrize(
    "scope, name",
    [
        ("encoder.block.3.layer.0.SelfAttention.q", "enc3_attn_q"),
        ("decoder.block.11.layer.1.EncDecAttention.k", "dec11_xattn_k"),
        ("encoder.block.0.layer.1.DenseReluDense.wo", "enc0_ff_wo"),
        ("transformer.h.5.attn.c_proj", "h5_attn_c_proj"),
        ("bert.encoder.layer.2.attention.self.query", "enc2_attn_query"),
        ("decoder.final_layer_norm", "dec_ln_f"),
        ("lm_head", "lm_head"),
        ("", ""),
    ],
)
def test_names_from_scopes(scope, name):
    assert abbreviate(scope) == name
