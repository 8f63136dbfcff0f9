"""measured_costs: the costed graph it returns, host swapping, weights, the memory limit."""

from __future__ import annotations

import pytest
import torch
from ftpipe_runtime.spec.weights import WRAPPER_PREFIX

from ftpipe_compiler.costs.analytic import analytic_costs
from ftpipe_compiler.costs.hardware import get_hardware
from ftpipe_compiler.costs.measured import measured_costs
from ftpipe_compiler.costs.profilers import costed_graph
from ftpipe_compiler.costs.weights import Weights
from ftpipe_compiler.errors import FtpipeError, UnknownNameError
from ftpipe_compiler.graph.trace import trace_model
from ftpipe_compiler.model.tasks import resolve_task


def _whole_model_loss(spec, traced, seed=0) -> float:
    """The unpartitioned HF model's loss, with the very parameters the profiler made."""
    model = spec.build("cpu")
    weights = Weights(traced, spec, torch.device("cpu"), seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(weights.materialise({"x": name.removeprefix(WRAPPER_PREFIX)})["x"])
        return float(model(*weights.model_inputs().values()))


@pytest.mark.parametrize("granularity", ["op", "layer"])
def test_same_graph_as_analytic_with_measured_times(granularity, seed):
    spec, _, traced, _ = costed_graph("t5-tiny")
    graph = measured_costs(traced, spec, granularity=granularity, repeats=1, cache=False)
    analytic = analytic_costs(traced, get_hardware("rtx2080ti"), granularity)
    assert (graph.profile, graph.hardware, graph.granularity) == ("measured", "cpu", granularity)
    assert [n.id for n in graph.nodes] == [n.id for n in analytic.nodes]
    assert [n.flops for n in graph.nodes] == [n.flops for n in analytic.nodes]
    assert graph.edges == analytic.edges and graph.params == analytic.params
    assert all(n.fwd_s > 0 and n.recompute_s > 0 for n in graph.nodes)
    # Backward is timed exactly where a gradient flows, and nowhere else.
    for n in graph.nodes:
        trains = any(graph.param[p].trainable for p in n.params)
        assert n.bwd_s > 0 if trains else True, n.id
        assert n.bwd_s == 0 if not n.requires_grad else True, n.id
    # Autograd keeps activations for the layers that carry gradient.
    assert all(n.act_bytes > 0 for n in graph.nodes if n.params and n.requires_grad)


@pytest.mark.parametrize("name", ["t5-tiny", "gpt2-tiny", "bert-tiny"])
def test_block_by_block_loss_is_the_whole_models(name, seed):
    """Host swapping feeds every block the real values of the blocks before it: the loss
    computed one block at a time is the loss of the whole model with the same weights.
    (bert-tiny also checks its buffers: position_ids are real, not zeros.)"""
    spec, _, traced, _ = costed_graph(name, granularity="layer")
    graph = measured_costs(traced, spec, granularity="layer", repeats=1, cache=False)
    measured = graph.meta["measured"]
    assert measured["weights"] == "random"
    assert measured["loss"] == pytest.approx(_whole_model_loss(spec, traced), rel=1e-5)


def test_real_weights_from_safetensors(gpt2_with_weights, seed):
    import transformers

    spec, task, traced, _ = costed_graph(gpt2_with_weights, seq_len=16, micro_batch=2)
    graph = measured_costs(traced, spec, granularity="op", repeats=1, cache=False)
    assert graph.meta["measured"]["weights"] == "safetensors"
    model = transformers.GPT2LMHeadModel.from_pretrained(gpt2_with_weights)
    inputs = spec.example_inputs(task, 2, "cpu")
    with torch.no_grad():
        expected = float(model(**inputs).loss)
    assert graph.meta["measured"]["loss"] == pytest.approx(expected, rel=1e-5)


def test_program_weights_are_used_when_traced_on_a_real_device(tiny_t5):
    spec, task, model, traced = tiny_t5
    graph = measured_costs(traced, spec, granularity="layer", repeats=1, cache=False)
    assert graph.meta["measured"]["weights"] == "program"
    inputs = spec.example_inputs(task, task.micro_batch, "cpu")
    with torch.no_grad():
        expected = float(model(*inputs.values()))
    assert graph.meta["measured"]["loss"] == pytest.approx(expected, rel=1e-5)


def test_a_block_over_the_limit_is_named_before_anything_runs(t5_tiny_layer, timed_blocks):
    spec, _, traced, analytic = t5_tiny_layer
    with pytest.raises(FtpipeError) as e:
        measured_costs(traced, spec, granularity="layer", memory_limit_gb=1e-4)
    message = str(e.value)
    assert message.startswith("block encoder.block.0 needs 0.00 GB on its own")
    assert "--memory-limit 0.0001 GB; use --granularity op" in message
    assert timed_blocks == []
    # The same model fits when the limit holds its biggest block: parameters and their
    # gradients at least, by the graph's own parameter sizes.
    graph = measured_costs(traced, spec, granularity="layer", memory_limit_gb=1e-3, repeats=1)
    big = graph.meta["measured"]["largest_block"]
    node = graph.node[big["id"]]
    assert 2 * sum(graph.param[p].bytes for p in node.params) <= big["bytes"] <= 1e6
    assert len(timed_blocks) == len(graph.nodes)


def test_op_granularity_advice_is_to_raise_the_limit(t5_tiny_layer):
    spec, _, traced, _ = t5_tiny_layer
    with pytest.raises(FtpipeError, match="raise --memory-limit$"):
        measured_costs(traced, spec, granularity="op", memory_limit_gb=1e-6)


def test_option_errors(t5_tiny_layer):
    spec, _, traced, _ = t5_tiny_layer
    with pytest.raises(UnknownNameError, match="unknown device 'tpu'; choose from cpu, cuda"):
        measured_costs(traced, spec, device="tpu")
    with pytest.raises(FtpipeError, match="--repeats must be at least 1"):
        measured_costs(traced, spec, repeats=0)
    with pytest.raises(FtpipeError, match="--memory-limit must be a positive number of GB"):
        measured_costs(traced, spec, memory_limit_gb=0)
    if not torch.cuda.is_available():
        with pytest.raises(FtpipeError, match="^CUDA is not available on this machine; use --"):
            measured_costs(traced, spec, device="cuda")


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_cuda_profile_matches_the_cpu_loss(seed):
    spec, task, _, _ = costed_graph("t5-tiny")
    model = spec.build("meta", dropout=0.0)
    traced = trace_model(spec, resolve_task(spec, None), task.micro_batch, model=model)
    gpu = measured_costs(traced, spec, granularity="layer", device="cuda", repeats=2)
    cpu = measured_costs(traced, spec, granularity="layer", device="cpu", repeats=1)
    assert gpu.hardware == torch.cuda.get_device_name()
    assert gpu.meta["measured"]["peak_bytes"] > 0
    assert gpu.meta["measured"]["loss"] == pytest.approx(cpu.meta["measured"]["loss"], rel=1e-4)
    assert all(n.recompute_s > 0 for n in gpu.nodes)
