"""Frozen parameters and LoRA at compile time: the traced graph, the costs, the plan's record.

GPT-2 tiny with its embeddings and block 0 frozen against the same model unfrozen: frozen
weights are marked and have no gradient or optimizer state in the memory model; the prefix
nothing trainable feeds has no backward, no recompute and keeps no activation; an op whose
weights are all frozen but which a gradient crosses costs one forward of backward (dX only)
instead of two; a stage of the prefix is forward-only, and the plan round-trips with it.
"""

from __future__ import annotations

import pytest
from ftpipe_runtime.models.lora import LoraSpec

from ftpipe_compiler.costs.profilers import costed_graph
from ftpipe_compiler.partition import build_plan, problem_from_graph
from ftpipe_compiler.plan import Plan

FREEZE = r"transformer.(wte|wpe|h.0\.)"


@pytest.fixture(scope="module")
def graphs():
    pytest.importorskip("transformers")
    _, _, _, plain = costed_graph("gpt2-tiny", hardware="rtx2080ti")
    _, _, _, frozen = costed_graph("gpt2-tiny", hardware="rtx2080ti", freeze=FREEZE)
    return plain, frozen


def test_frozen_weights_are_marked_and_cost_no_state(graphs):
    plain, frozen = graphs
    marked = {p.name for p in frozen.params if p.frozen}
    assert "transformer.wte.weight" in marked and "transformer.h.0.attn.c_attn.weight" in marked
    assert not any(n.startswith("transformer.h.1.") for n in marked)
    assert not any(p.trainable for p in frozen.params if p.frozen)
    assert frozen.meta["freeze"] == FREEZE
    static = problem_from_graph(frozen, 2).static_bytes
    by_name = {p.name: p for p in frozen.params}
    for name in marked:  # the weight itself, nothing more
        assert static[name] == by_name[name].bytes


def test_the_prefix_has_no_backward_and_frozen_ops_only_dx(graphs):
    plain, frozen = graphs
    before = {n.id: n for n in plain.nodes}
    prefix = [n for n in frozen.nodes if n.scope.startswith("transformer.h.0.")]
    assert prefix and all(n.bwd_s == 0 and n.recompute_s == 0 and n.act_bytes == 0 for n in prefix)
    # wte is tied to the LM head: frozen there too, but a gradient crosses it (dX only)
    head = [n for n in frozen.nodes if "transformer.wte.weight" in n.params and n.requires_grad]
    assert head
    for n in head:
        assert before[n.id].bwd_s > n.bwd_s == pytest.approx(n.fwd_s, rel=1e-9)  # 1 forward, not 2
        assert n.wgrad_s == 0
    assert sum(n.bwd_s for n in frozen.nodes) < sum(n.bwd_s for n in plain.nodes)


def test_a_plan_records_frozen_weights_and_forward_only_stages(graphs):
    _, frozen = graphs
    problem = problem_from_graph(frozen, 2, schedule="1f1b")
    first = {n.id: 0 if n.scope.startswith("transformer.h.0.") or not n.requires_grad else 1
             for n in frozen.nodes}  # fmt: skip
    first[frozen.output] = 1
    plan = build_plan(problem, first, {0: 0, 1: 1}, "by hand")
    stage0 = plan.stages[0]
    assert stage0.forward_only and stage0.bwd_s == 0 and not plan.stages[1].forward_only
    assert any(p.frozen for p in plan.params)
    assert Plan.from_dict(plan.to_dict()) == plan
    older = plan.to_dict()  # a plan written before frozen parameters existed still reads
    for p in older["params"]:
        del p["frozen"]
    for s in older["stages"]:
        del s["forward_only"]
    assert not any(p.frozen for p in Plan.from_dict(older).params)


def test_lora_spec_parses_and_round_trips():
    spec = LoraSpec.parse("r=16,alpha=32,targets=q_proj,v_proj,dropout=0.05")
    assert spec == LoraSpec(16, 32.0, ("q_proj", "v_proj"), 0.05)
    assert LoraSpec.from_json(spec.to_json()) == spec
    assert LoraSpec.parse("targets=c_attn,r=2,alpha=4").targets == ("c_attn",)


@pytest.mark.parametrize("bad", ["alpha=nan", "alpha=inf", "alpha=-1", "dropout=nan", "r=0"])
def test_lora_spec_refuses_what_would_train_nan(bad):
    """`alpha=nan` passed `alpha <= 0` (every comparison with nan is false): the plan held a
    bare NaN and the package trained to loss nan, exit 0."""
    fields = {"r": "4", "alpha": "8", "targets": "q_proj", "dropout": "0"}
    key, value = bad.split("=")
    text = ",".join(f"{k}={value if k == key else v}" for k, v in fields.items())
    with pytest.raises(ValueError, match="alpha > 0, dropout in"):
        LoraSpec.parse(text)
