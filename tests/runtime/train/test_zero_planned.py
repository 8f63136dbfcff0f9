"""A plan whose stages the planner shards (`shard_optimizer` of each plan.json stage, chosen
by `planner.offload.choose_offload`) in the runtime: the generated package, on 2 replicas x 2
CPU ranks, keeps each sharded stage's optimizer state halved and ends where the same package
run with --no-shard-optimizer ends, bit for bit in fp32, and writes the same HuggingFace
folder (--save-hf)."""

from __future__ import annotations

import json

import pytest
import torch
from runtime_reference import checkpoint_params

STEPS = 3


@pytest.fixture(scope="module")
def package(tmp_path_factory):
    """(package, its plan.json, init weights): GPT-2 tiny in 2 stages on 2 ranks, 2 replicas,
    every stage sharded by the planner (--shard-optimizer always)."""
    pytest.importorskip("transformers")
    from ftpipe_compiler.codegen import generate_package
    from ftpipe_compiler.costs.hardware import get_hardware
    from ftpipe_compiler.costs.profilers import costed_graph
    from ftpipe_compiler.partition import build_plan
    from ftpipe_compiler.partition.problem import Problem
    from ftpipe_compiler.planner import placement
    from ftpipe_compiler.planner.offload import choose_offload

    spec, _, traced, graph = costed_graph("gpt2-tiny")
    n = len(graph.nodes)
    stage_of = {node.id: i * 2 // n for i, node in enumerate(graph.nodes)}
    problem = Problem(graph, gpus=2, hardware=get_hardware("cpu"), memory_bytes=2**50)
    plan = build_plan(problem, stage_of, {0: 0, 1: 1}, "test")
    plan = plan.with_(replicas=2, placement=placement(2, 2, "pipeline"))
    plan = choose_offload(plan, "none", "always")
    folder = tmp_path_factory.mktemp("sharded")
    pkg = generate_package(traced, graph, plan, spec, folder, command="pytest")
    init = tmp_path_factory.mktemp("init") / "init.pt"
    torch.save(spec.build("cpu", dropout=0.0, seed=0).m.state_dict(), init)
    return pkg, json.loads((pkg / "plan.json").read_text()), init


@pytest.mark.multiproc
@pytest.mark.slow
def test_a_package_the_planner_sharded_trains_as_the_one_without(run_pipeline, package, tmp_path):
    pkg, plan, init = package
    assert [st["shard_optimizer"] for st in plan["stages"]] == [True, True]
    got = {}
    for name, flag in (("sharded", []), ("whole", ["--no-shard-optimizer"])):
        ckpt, log = tmp_path / name, tmp_path / f"{name}.json"
        argv = ["--steps", str(STEPS), "--schedule", "1f1b", "--init", str(init),
                "--optimizer", "adamw", "--lr", "0.01", "--weight-decay", "0.01",
                "--save-every", str(STEPS), "--checkpoint-dir", str(ckpt),
                "--log-json", str(log), "--save-hf", str(tmp_path / f"{name}-hf"),
                *flag]  # fmt: skip
        codes, ranks = run_pipeline(plan, argv, name=name, module=pkg.name, cwd=pkg.parent)
        assert codes == [0] * 4, ranks.stderr()
        got[name] = (json.loads(log.read_text()), checkpoint_params(ckpt, STEPS, range(2)))
    (sharded, weights), (whole, want) = got["sharded"], got["whole"]
    assert sharded["losses"] == whole["losses"]
    assert weights.keys() == want.keys()
    for key, value in want.items():
        assert torch.equal(weights[key], value), key
    # --save-hf with replicas: rank 0's pipeline sends, the sharded masters put together
    # first; both folders hold the checkpoint's weights.
    from safetensors.torch import load_file

    folders = {n: load_file(tmp_path / f"{n}-hf" / "model.safetensors") for n in got}
    assert folders["sharded"].keys() == folders["whole"].keys()
    for key, value in folders["whole"].items():
        assert torch.equal(folders["sharded"][key], value), key
        if key in want:
            assert torch.equal(value, want[key]), key
    assert set(want) & set(folders["whole"])
    # The plan's choice ran: each rank keeps about half of its stage's AdamW state.
    for rank in range(4):
        ratio = sharded["optimizer_state_bytes"][rank] / whole["optimizer_state_bytes"][rank]
        assert 0.45 < ratio < 0.55, (rank, ratio)
