"""The generated stages, chained in one process, compute the original model's loss and gradients.

The reference is the HuggingFace model executed eagerly (dropout off) with the same weights;
the stages run their generated code, never the fx graph.
"""

from __future__ import annotations

import json
import random

import pytest
from codegen_helpers import TINY, contiguous, costed, plan_from_cuts, problem
from ftpipe_runtime.job import check
from ftpipe_runtime.models import with_dropout
from ftpipe_runtime.stage.api import run_in_one_process

from ftpipe_compiler import partition
from ftpipe_compiler.codegen import check_package, generate_package, import_package
from ftpipe_compiler.model.zoo import resolve_model

LAYOUTS = {
    "2 stages": lambda g: contiguous(g, 2),
    "3 stages": lambda g: contiguous(g, 3),
    "4 stages on 2 GPUs": lambda g: contiguous(g, 4, gpus=2),  # Mixed-style: 2 stages per GPU
}


def _check(model, plan, tmp_path, granularity="op"):
    spec, _, traced, graph = costed(model, granularity)
    pkg = generate_package(traced, graph, plan, spec, tmp_path, command="pytest")
    result = check_package(pkg)
    assert result.loss == pytest.approx(result.reference_loss, rel=1e-5)
    assert result.ok, result
    assert result.params_compared == sum(1 for p in plan.params if p.trainable and p.stages)
    return result


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("model", TINY)
def test_stages_match_the_original_model(model, layout, tmp_path):
    graph = costed(model)[3]
    plan = LAYOUTS[layout](graph)
    if model != "bert-tiny":  # T5 and GPT-2 tie embeddings and head: the readers land apart
        tied = next(p for p in plan.params if p.aliases)
        sent = next(t for t in plan.transfers if t.tensor == tied.name)
        assert len(tied.stages) == 1 and sent.producer == tied.stages[0] and sent.consumers
    _check(model, plan, tmp_path)


@pytest.mark.parametrize("model", TINY)
def test_layer_granularity(model, tmp_path):
    graph = costed(model, "layer")[3]
    _check(model, contiguous(graph, 3, gpus=2), tmp_path, "layer")


def test_many_cut_points(tmp_path, seed):
    """Cuts anywhere in the op order, T5 (the model with the most cross-stage masks and biases)."""
    rng = random.Random(seed)
    graph = costed("t5-tiny")[3]
    n = len(graph.nodes)
    for trial in range(6):
        cuts = sorted(rng.sample(range(1, n), rng.randint(1, 6)))
        _check("t5-tiny", plan_from_cuts(graph, cuts), tmp_path / str(trial))


PARTITIONERS = sorted(getattr(partition, "PARTITIONERS", {}))


@pytest.mark.skipif(not PARTITIONERS, reason="no partitioner registered yet")
@pytest.mark.parametrize("name", PARTITIONERS)
@pytest.mark.parametrize("model", TINY)
def test_every_partitioner(model, name, tmp_path):
    graph = costed(model)[3]
    plan = partition.PARTITIONERS[name](problem(graph, gpus=2))
    _check(model, plan, tmp_path)


@pytest.mark.parametrize("model, task", [("t5-tiny", "tiny-seq2seq"), ("bert-tiny", "tiny-qa")])
def test_dropout_follows_the_stage_mode(model, task, tmp_path):
    """Traced with dropout 0.1 (in dropout layers and inside attention): the check, stages in
    eval mode, matches the model without dropout; in train mode the stages do drop."""
    config = with_dropout(resolve_model(model).config, 0.1)
    folder = tmp_path / f"{model.replace('-', '_')}_dropout"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    spec, _, traced, graph = costed(str(folder), task=task)
    assert any(
        "0.1" in str(n.args) for n in traced.program.graph.nodes if "scaled_dot" in str(n.target)
    )
    pkg = generate_package(traced, graph, contiguous(graph, 3, gpus=2), spec, tmp_path, "pytest")
    assert "0.1 if self.training else 0.0" in (pkg / "stages.py").read_text()
    assert check_package(pkg).ok
    mod = import_package(pkg)
    stages = {k: cls() for k, cls in mod.STAGES.items()}
    inputs = check.synthetic_inputs(mod.load_plan())
    plan = mod.load_plan()
    losses = [run_in_one_process(stages, plan, inputs, backward=False).item() for _ in range(2)]
    for s in stages.values():
        s.eval()
    quiet = [run_in_one_process(stages, plan, inputs, backward=False).item() for _ in range(2)]
    assert quiet[0] == quiet[1] and losses[0] != losses[1]
