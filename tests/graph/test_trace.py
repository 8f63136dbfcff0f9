import pytest
import torch
from interpret import run_graph

from ftpipe_compiler.errors import TraceError
from ftpipe_compiler.graph.granularity import collapse, layer_key
from ftpipe_compiler.graph.trace import trace_model
from ftpipe_compiler.model.tasks import resolve_task
from ftpipe_compiler.model.zoo import resolve_model


@pytest.mark.parametrize("fixture", ["tiny_t5", "tiny_gpt2", "tiny_bert"])
@pytest.mark.parametrize("granularity", ["op", "layer"])
def test_graph_executes_to_the_eager_loss(request, fixture, granularity, seed):
    spec, task, model, traced = request.getfixturevalue(fixture)
    inputs = spec.example_inputs(task, task.micro_batch, "cpu", seed=3)
    eager = model(*inputs.values())
    graph = traced.graph if granularity == "op" else collapse(traced.graph)
    loss = run_graph(traced, graph, dict(model.named_parameters()), inputs)
    torch.testing.assert_close(loss, eager, rtol=1e-6, atol=0)


def test_layer_granularity_groups_t5_blocks(tiny_t5):
    graph = collapse(tiny_t5[3].graph)
    scopes = {n.scope for n in graph.nodes}
    assert {"encoder.block.0", "encoder.block.1", "decoder.block.0", "decoder.block.1"} <= scopes
    assert len(graph.nodes) < len(tiny_t5[3].graph.nodes) / 5
    # Collapsing keeps every traced op exactly once.
    members = [m for n in graph.nodes for m in n.members]
    assert sorted(members) == sorted(n.id for n in tiny_t5[3].graph.nodes)


def test_layer_key():
    assert layer_key("encoder.block.3.layer.0.SelfAttention") == "encoder.block.3"
    assert layer_key("transformer.h.11.attn") == "transformer.h.11"
    assert layer_key("encoder.final_layer_norm") == "encoder.final_layer_norm"


def test_t5_tied_embedding_appears_once(tiny_t5):
    graph = tiny_t5[3].graph
    tied = [p for p in graph.params if p.aliases]
    assert len(tied) == 1
    assert tied[0].name == "shared.weight"
    assert set(tied[0].aliases) == {
        "encoder.embed_tokens.weight",
        "decoder.embed_tokens.weight",
        "lm_head.weight",
    }
    model = tiny_t5[2]
    assert graph.num_parameters == sum(p.numel() for p in model.parameters())


def test_gpt2_tied_embedding_appears_once(tiny_gpt2):
    graph = tiny_gpt2[3].graph
    names = [p.name for p in graph.params] + [a for p in graph.params for a in p.aliases]
    assert len(names) == len(set(names))
    wte = graph.param["transformer.wte.weight"]
    assert wte.aliases == ("lm_head.weight",)
    # Every parameter has exactly one owner node.
    assert set(graph.owner) == {p.name for p in graph.params}


def test_validate_and_node_facts(tiny_t5):
    graph = tiny_t5[3].graph
    graph.validate()
    assert graph.output == graph.nodes[-1].id
    linear = next(n for n in graph.nodes if n.op == "aten.linear.default")
    assert linear.params and linear.requires_grad and linear.scope.startswith("encoder.block.0")
    assert linear.module_type == "Linear"
    mask_ops = [n for n in graph.nodes if n.dtype in ("int64", "bool")]
    assert mask_ops and not any(n.requires_grad for n in mask_ops)


def test_untraceable_model_gets_the_exporters_reason():
    spec = resolve_model("zoo_fixtures:untraceable_model")
    with pytest.raises(TraceError, match="--granularity layer"):
        trace_model(spec, resolve_task(spec, None), 4)


def test_no_grad_regions_are_spliced_in_detached(seed):
    """torch.export wraps code under torch.no_grad() in a sub-graph call (Llama's rotary embedding
    up to transformers 5.23; a model of our own here, so the test needs that behaviour of export,
    not one release of a library): the graph holds its ATen ops instead, its outputs detached, and
    still executes to the eager loss."""
    spec = resolve_model("zoo_fixtures:no_grad_model")
    task = resolve_task(spec, None)
    model = spec.build("cpu", dropout=0.0, seed=0)
    inputs = spec.example_inputs(task, task.micro_batch, "cpu", seed=3)
    exported = torch.export.export(model, tuple(inputs.values()))
    wrapped = [n for n in exported.graph.nodes if "wrap_with" in str(n.target)]
    assert wrapped, "export no longer wraps no_grad code: this test checks nothing"
    traced = trace_model(spec, task, task.micro_batch, device="cpu", model=model)
    ops = [str(n.target) for n in traced.program.graph.nodes if n.op == "call_function"]
    assert not [op for op in ops if "wrap_with" in op]
    cut = [n for n in traced.graph.nodes if n.op == "aten.detach.default"]
    assert len(cut) == 2 and not any(n.requires_grad for n in cut)  # cos and sin
    loss = run_graph(traced, traced.graph, dict(model.named_parameters()), inputs)
    torch.testing.assert_close(loss, model(*inputs.values()), rtol=1e-6, atol=0)


def test_traced_code_is_made_on_demand_and_runs(tiny_gpt2):
    """The trace defers fx's code generation (`code_on_demand`): torch's own constructor is
    back afterwards, and the program's module still makes its code, and runs to the eager
    loss, when asked."""
    import torch.export.exported_program as ep

    from ftpipe_compiler.graph.trace import code_on_demand

    made = ep._create_graph_module_for_export
    with code_on_demand():
        assert ep._create_graph_module_for_export is not made
    assert ep._create_graph_module_for_export is made
    spec, task, model, traced = tiny_gpt2
    assert "def forward" in traced.program.graph_module.code
    inputs = spec.example_inputs(task, task.micro_batch, "cpu", seed=3)
    got = traced.program.module()(*inputs.values())
    torch.testing.assert_close(got, model(*inputs.values()), rtol=1e-6, atol=0)
