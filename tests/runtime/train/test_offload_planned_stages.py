"""The plan's per-stage offload (`offload` of each plan.json stage) in the runtime: the stages
it names keep their masters and optimizer state on the host, the others beside their
weights; a generated package trained so on 2 CPU ranks ends where the same package without
it ends, bit for bit in fp32."""

from __future__ import annotations

import json
import shutil
from dataclasses import replace

import pytest
import torch
from ftpipe_runtime.spec.topology import Topology
from ftpipe_runtime.train.offload import HostOffload
from ftpipe_runtime.train.precision import MixedPrecision, get_precision
from runtime_helpers import crash_and_resume
from runtime_reference import checkpoint_params
from runtime_toy import toy_plan

from ftpipe_compiler.costs.host import Offload

STEPS = 3


def test_the_topology_reads_each_stage_s_offload():
    plan = toy_plan("two-ranks", "1f1b")
    assert Topology(plan).offload_optimizer == frozenset()  # a plan without the field
    plan["stages"][1]["offload"] = {"optimizer": True, "activations": False}
    plan["stages"][2]["offload"] = {"optimizer": False, "activations": True}
    topo = Topology(plan)
    assert (topo.offload_optimizer, topo.offload_activations) == ({1}, {2})


def test_only_the_offloaded_stages_keep_their_masters_on_the_host():
    torch.manual_seed(0)
    modules = {s: torch.nn.Linear(4, 3).to(torch.bfloat16) for s in (0, 2)}
    mixed = MixedPrecision(get_precision("bf16"), modules, offload=HostOffload("cpu"),
                           offloaded={2})  # fmt: skip
    assert (mixed.offloads(0), mixed.offloads(2)) == (False, True)
    weights = {id(p) for m in modules.values() for p in m.parameters()}
    for s in (0, 2):
        for _, master in mixed.trainable(s):
            assert master.dtype == torch.float32 and id(master) not in weights
    # Stage 0's gradients sum beside its weights, stage 2's go through the host's buffers.
    for m in modules.values():
        m(torch.ones(2, 4, dtype=torch.bfloat16)).sum().backward()
    assert set(mixed._host[2]._buffers) == {id(t) for _, t in mixed.trainable(2)}
    assert all(t.grad is not None for s in (0, 2) for _, t in mixed.trainable(s))


@pytest.fixture(scope="module")
def packages(tmp_path_factory):
    """(plain package, the same plan with stages 0 and 1 offloaded, init weights): GPT-2 tiny
    in 3 stages on 2 ranks (stages 0 and 2 on rank 0: one offloaded beside one not)."""
    pytest.importorskip("transformers")
    from ftpipe_compiler.codegen import generate_package
    from ftpipe_compiler.costs.hardware import get_hardware
    from ftpipe_compiler.costs.profilers import costed_graph
    from ftpipe_compiler.partition import build_plan
    from ftpipe_compiler.partition.problem import Problem

    spec, _, traced, graph = costed_graph("gpt2-tiny")
    n = len(graph.nodes)
    stage_of = {node.id: i * 3 // n for i, node in enumerate(graph.nodes)}
    problem = Problem(graph, gpus=2, hardware=get_hardware("cpu"), memory_bytes=2**50)
    plain = build_plan(problem, stage_of, {0: 0, 1: 1, 2: 0}, "test")
    chosen = {0: Offload(optimizer=True), 1: Offload(optimizer=True), 2: Offload()}
    offloaded = plain.with_(stages=tuple(replace(s, offload=chosen[s.id]) for s in plain.stages))
    out = []
    for name, plan in (("plain", plain), ("offloaded", offloaded)):
        folder = tmp_path_factory.mktemp(name)
        pkg = generate_package(traced, graph, plan, spec, folder, command="pytest")
        out.append((pkg, json.loads((pkg / "plan.json").read_text())))
    init = tmp_path_factory.mktemp("init") / "init.pt"
    torch.save(spec.build("cpu", dropout=0.0, seed=0).m.state_dict(), init)
    return out, init


@pytest.mark.multiproc
@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["1f1b", "ftpipe"])
def test_a_package_offloading_some_stages_trains_as_the_one_without(
    run_pipeline, packages, tmp_path, schedule
):
    (plain, offloaded), init = packages
    assert [s["offload"]["optimizer"] for s in offloaded[1]["stages"]] == [True, True, False]
    got = []
    for name, (pkg, plan) in (("plain", plain), ("offloaded", offloaded)):
        ckpt, log = tmp_path / name, tmp_path / f"{name}.json"
        argv = ["--steps", str(STEPS), "--schedule", schedule, "--init", str(init),
                "--optimizer", "adamw", "--lr", "0.01", "--clip", "0.5", "--weight-decay",
                "0.01", "--save-every", str(STEPS), "--checkpoint-dir", str(ckpt),
                "--log-json", str(log)]  # fmt: skip
        codes, ranks = run_pipeline(plan, argv, name=name, module=pkg.name, cwd=pkg.parent)
        assert codes == [0, 0], ranks.stderr()
        said = "optimizer state of stages 0, 1 in host memory" in ranks.stderr(0)
        assert said == (name == "offloaded"), ranks.stderr(0)
        got.append(
            (json.loads(log.read_text())["losses"], checkpoint_params(ckpt, STEPS, range(3)))
        )
    (losses, weights), (off_losses, off_weights) = got
    assert off_losses == losses
    assert off_weights.keys() == weights.keys()
    for name, value in weights.items():
        assert torch.equal(off_weights[name], value), name


@pytest.mark.multiproc
@pytest.mark.slow
def test_a_package_whose_plan_lags_its_offloaded_steps_trains_as_the_flag_says(
    run_pipeline, packages, tmp_path
):
    """The generated package whose plan.json lags stages 0 and 1 (`offload.step`, as
    `compile --offload-step lagged` writes it) trains under ftpipe as the same package without
    that field run with `--offload-step lagged`, bit for bit; not as with exact steps."""
    (_, (pkg, plan)), init = packages
    lagged = tmp_path / "lagged"
    shutil.copytree(pkg.parent, lagged)
    lagged_plan = json.loads((lagged / pkg.name / "plan.json").read_text())
    for st in lagged_plan["stages"]:
        if st["offload"]["optimizer"]:
            st["offload"]["step"] = "lagged"
    (lagged / pkg.name / "plan.json").write_text(json.dumps(lagged_plan))
    got = {}
    for name, folder, the_plan, extra in (
        ("plan", lagged, lagged_plan, []),
        ("flag", pkg.parent, plan, ["--offload-step", "lagged"]),
        ("exact", pkg.parent, plan, []),
    ):
        ckpt, log = tmp_path / name, tmp_path / f"{name}.json"
        argv = ["--steps", str(STEPS), "--schedule", "ftpipe", "--init", str(init),
                "--optimizer", "adamw", "--lr", "0.01", "--save-every", str(STEPS),
                "--checkpoint-dir", str(ckpt), "--log-json", str(log), *extra]  # fmt: skip
        codes, ranks = run_pipeline(the_plan, argv, name=name, module=pkg.name, cwd=folder)
        assert codes == [0, 0], ranks.stderr()
        got[name] = (
            json.loads(log.read_text())["losses"],
            checkpoint_params(ckpt, STEPS, range(3)),
        )
    assert got["plan"][0] == got["flag"][0] != got["exact"][0]
    for name, value in got["flag"][1].items():
        assert torch.equal(got["plan"][1][name], value), name


# --- gradients summed on the device (`offload.gradients == "device"`), copied once a step ---

DEVICE_SUM = {"optimizer": True, "activations": False, "gradients": "device"}
ARGV = ["--data", "copy", "--optimizer", "adamw", "--lr", "0.05", "--weight-decay", "0.01"]


def _summing_on_device(plan: dict, stages) -> dict:
    """`plan` with `stages` offloading their optimizer, their gradients summed on the device."""
    chosen = [{**st, "offload": DEVICE_SUM} if st["id"] in stages else st for st in plan["stages"]]
    return {**plan, "stages": chosen}


def test_the_topology_reads_where_gradients_sum():
    plan = _summing_on_device(toy_plan("two-ranks", "1f1b"), {2})
    plan["stages"][1]["offload"] = {"optimizer": True, "activations": False}  # before the field
    topo = Topology(plan)
    assert (topo.offload_optimizer, topo.sums_on_device) == ({1, 2}, {2})


@pytest.mark.multiproc
@pytest.mark.parametrize(("schedule", "dtype"), [("1f1b", "bfloat16"), ("ftpipe", "float32")])
def test_gradients_summed_on_the_device_train_as_without_offload(
    run_pipeline, tmp_path, schedule, dtype
):
    """Stages 0-2 of 4 (on both ranks) sum their gradients on the device and step on the
    host: the same additions in the same order as without offload, the same CPU kernel, so
    the weights are bit for bit those of the run without (bf16's masters included)."""
    plain = toy_plan("two-ranks", schedule, 4, dtype)
    name = {"bfloat16": "bf16", "float32": "fp32"}[dtype]
    got = []
    for label, plan in (("plain", plain), ("summed", _summing_on_device(plain, {0, 1, 2}))):
        ckpt, log = tmp_path / label, tmp_path / f"{label}.json"
        argv = [*ARGV, "--steps", str(STEPS), "--schedule", schedule, "--dtype", name,
                "--clip", "0.5", "--save-every", str(STEPS), "--checkpoint-dir", str(ckpt),
                "--log-json", str(log)]  # fmt: skip
        codes, ranks = run_pipeline(plan, argv, name=label)
        assert codes == [0, 0], ranks.stderr()
        said = "optimizer state of stages 0, 1, 2 in host memory" in ranks.stderr(0)
        assert said == (label == "summed"), ranks.stderr(0)
        got.append(
            (json.loads(log.read_text())["losses"], checkpoint_params(ckpt, STEPS, range(4)))
        )
    (losses, weights), (summed_losses, summed_weights) = got
    assert summed_losses == losses
    assert summed_weights.keys() == weights.keys()
    for key, value in weights.items():
        assert torch.equal(summed_weights[key], value), key


@pytest.mark.multiproc
def test_resume_with_gradients_summed_on_the_device_is_exact(run_pipeline, tmp_path):
    """Stopped after a checkpoint and resumed, an ftpipe run whose stages sum their
    gradients on the device ends where the uninterrupted one ends (the sums are a step's
    alone: nothing of them is in the checkpoint, nothing lost)."""
    plan = _summing_on_device(toy_plan("two-ranks", "ftpipe"), {0, 1, 2, 3})
    argv = [*ARGV, "--steps", "6", "--save-every", "2"]
    whole, resumed = crash_and_resume(
        run_pipeline, tmp_path, plan, argv, range(4), fault="1:3:exit"
    )
    first = resumed["first_step"]
    assert first in (2, 4)
    assert resumed["losses"] == whole["losses"][first:]
