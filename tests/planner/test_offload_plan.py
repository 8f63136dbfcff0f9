"""The planner's offload choice per stage (`planner/offload.py`), the search with it, and the
plan's per-stage `offload` field."""

from __future__ import annotations

import json
import math
from dataclasses import replace

import pytest
from click.testing import CliRunner

from ftpipe_compiler.cli import cli
from ftpipe_compiler.costs.formulas import MemoryReserve
from ftpipe_compiler.costs.host import Offload
from ftpipe_compiler.errors import InfeasibleError
from ftpipe_compiler.partition import problem_from_graph, run_partitioner
from ftpipe_compiler.plan import Plan
from ftpipe_compiler.planner.matrix import NothingFits, search_matrix
from ftpipe_compiler.planner.nofit import check_floor, floor_fits
from ftpipe_compiler.planner.offload import choose_offload, searches
from ftpipe_compiler.units import size


@pytest.fixture(scope="module")
def problem(tiny_t5_costed):
    p = problem_from_graph(tiny_t5_costed, 2, "rtx2080ti", "1f1b", "adamw", 4)
    return replace(p, hardware=replace(p.hardware, memory_reserve=MemoryReserve()))


@pytest.fixture(scope="module")
def plan(problem):
    return run_partitioner(problem, "pipedream").plan


def test_a_plan_that_fits_is_left_as_it_is(plan):
    assert plan.feasible
    assert choose_offload(plan, "none") is plan
    auto = choose_offload(plan, "auto")
    assert [s.offload for s in auto.stages] == [Offload()] * len(plan.stages)
    assert auto.stages == plan.stages and auto.gpu_memory(0) == plan.gpu_memory(0)


def test_auto_offloads_only_on_the_gpu_that_does_not_fit(plan):
    """Capacity between the two GPUs' needs: only the fuller GPU's stages offload, the
    optimizer state first (the cheapest per byte here), and just enough for it to fit."""
    need = {g: plan.gpu_memory(g) for g in range(plan.gpus)}
    full, other = max(need, key=need.get), min(need, key=need.get)
    assert need[full] > need[other]
    tight = plan.with_(memory_bytes=(need[full] + need[other]) // 2)
    chosen = choose_offload(tight, "auto")
    assert all(not s.offload.any for s in chosen.stages_on(other))
    assert any(s.offload.optimizer for s in chosen.stages_on(full))
    assert all(chosen.gpu_memory(g) <= tight.memory_bytes for g in range(plan.gpus))
    assert chosen.model["offload"] == "auto"
    # It took nothing it did not need: undoing any one stage's offload overflows that GPU.
    for s in chosen.stages:
        if s.offload.any:
            undone = chosen.with_(
                stages=tuple(
                    replace(x, offload=Offload()) if x.id == s.id else x for x in chosen.stages
                )
            )
            assert undone.gpu_memory(s.gpu) > tight.memory_bytes


def test_forced_modes_offload_every_stage_that_has_it(plan):
    """(The GPUs fit with room to spare, and in fp32 m = 4 micro-batches' gradients are 4 x
    the sums' bytes: the gradients sum on the device.)"""
    opt = choose_offload(plan, "optimizer")
    assert all(s.offload == Offload(optimizer=True, gradients="device") for s in opt.stages)
    act = choose_offload(plan, "activations")
    assert all(s.offload == Offload(activations=not s.forward_only) for s in act.stages)


def test_the_plan_file_keeps_each_stage_s_offload(plan, tmp_path):
    chosen = choose_offload(plan.with_(memory_bytes=plan.gpu_memory(0) // 2), "auto")
    assert any(s.offload.any for s in chosen.stages)
    path = tmp_path / "plan.json"
    chosen.save(path)
    back = Plan.load(path)
    assert back == chosen
    assert back.to_dict() == chosen.to_dict()
    d = json.loads(path.read_text())
    assert set(d["stages"][0]["offload"]) == {"optimizer", "activations", "gradients", "step"}
    assert d["host"]["memory_bytes"] == plan.host.memory_bytes > 0
    # A plan written before offload (no per-stage field, no host): nothing offloaded.
    for s in d["stages"]:
        del s["offload"]
    del d["host"]
    old = Plan.from_dict(d)
    assert all(not s.offload.any for s in old.stages)


def test_the_search_offloads_only_when_nothing_fits_without(problem):
    """On GPUs too small for the optimizer state, the search without offload finds nothing;
    with `auto` every plan of the matrix that fits offloads, and its GPUs hold no state."""
    floor = sum(problem.static_bytes.values())
    small = replace(problem, memory_bytes=floor // 2 + problem.capacity - problem.memory)
    with pytest.raises(NothingFits):
        search_matrix(small, ["1f1b", "ftpipe"], ["pipedream"], workers=1, steps=4)
    best, matrix = search_matrix(
        replace(small, offload="auto"), ["1f1b", "ftpipe"], ["pipedream"], workers=1, steps=4
    )
    assert best.sim.fits and any(s.offload.optimizer for s in best.plan.stages)
    assert best.sim.nodes and best.sim.nodes[0].host_bytes > 0


def test_compile_without_need_writes_the_plan_of_offload_none(tmp_path):
    """`none` plans as before offload; `auto` on a model that fits changes nothing: the same
    plan file, byte for byte but the command line."""
    files = {}
    for mode in ("none", "auto"):
        out = tmp_path / mode
        args = ["compile", "-m", "t5-tiny", "-g", "2", "--hardware", "rtx2080ti", "--offload",
                mode, "--schedule", "1f1b,ftpipe", "-p", "pipedream,even-layers", "-j", "1",
                "-o", str(out)]  # fmt: skip
        r = CliRunner().invoke(cli, args)
        assert r.exit_code == 0, r.output
        d = json.loads((out / "plan.json").read_text())
        off = {"optimizer": False, "activations": False, "gradients": "host", "step": "exact"}
        assert all(s["offload"] == off for s in d["stages"])
        d.pop("command")
        d.pop("generated_by")  # the command line again, in the package's plan
        d.pop("search_seconds")
        d["competitors"] = [{k: v for k, v in c.items() if k != "search_seconds"}
                            for c in d["competitors"]]  # fmt: skip
        files[mode] = d
    assert files["none"] == files["auto"]


@pytest.mark.parametrize(("schedule", "step"), [("ftpipe", "lagged"), ("1f1b", "exact")])
def test_compile_lags_offloaded_steps_only_where_actions_read_the_weights_as_they_are(
    tmp_path, schedule, step
):
    """--offload-step lagged: under FTPipe's schedule each offloaded stage's step lands at its
    next S (the plan says so per stage, the compile's line too); under 1F1B, whose next
    forward needs the newest weights, it stays exact."""
    out = tmp_path / schedule
    args = ["compile", "-m", "t5-tiny", "-g", "2", "--hardware", "rtx2080ti", "--offload",
            "optimizer", "--offload-step", "lagged", "--schedule", schedule, "-p", "pipedream",
            "-j", "1", "-o", str(out)]  # fmt: skip
    r = CliRunner().invoke(cli, args)
    assert r.exit_code == 0, r.output
    d = json.loads((out / "plan.json").read_text())
    assert [s["offload"]["step"] for s in d["stages"]] == [step] * len(d["stages"])
    assert ("--offload-step lagged)" in r.output) == (step == "lagged")
    readme = next(out.glob("*/README.md")).read_text()  # the package's
    assert ("lagged (`offload.step`)" in readme) == (step == "lagged")
    said = "note: --offload-step lagged changes nothing here: its schedule (1f1b) runs each step"
    assert (said in r.output) == (schedule == "1f1b")


def test_a_plan_whose_host_overflows_does_not_fit(plan):
    opt = choose_offload(plan, "optimizer")
    assert opt.feasible and opt.host_fits
    small = opt.with_(host=replace(opt.host, memory_bytes=1000))
    assert not small.host_fits and not small.feasible
    with pytest.raises(Exception, match=r"node 0's host needs [\d.]+ GiB for what its stages"):
        small.validate()


def test_nothing_fits_even_offloaded_says_the_hosts_are_too_small(problem):
    """Offloading every stage's optimizer would leave the GPUs little, but the hosts cannot
    hold it: one sentence with both figures (host bytes: 20 per fp32 AdamW parameter)."""
    floor = sum(problem.static_bytes.values())
    hw = problem.hardware
    tiny_host = replace(hw, host=replace(hw.host, memory_bytes=floor // 2))
    small = replace(problem, hardware=tiny_host, offload="auto",
                    memory_bytes=floor // 2 + problem.capacity - problem.memory)  # fmt: skip
    assert not floor_fits(small)
    with pytest.raises(InfeasibleError) as e:
        check_floor(small, "t5-tiny", ["1f1b"], steps=4)
    said = str(e.value)
    host = 20 * sum(math.prod(p.shape) for p in problem.graph.params if p.trainable)
    assert (
        f"offloading to the host (--offload auto) leaves {size(floor / 4 / 2)} per GPU and "
        f"{size(host)} of host memory (the hosts have {size(floor // 2)}): more than the hosts "
        "hold" in said
    ), said
    assert "--offload auto (checked" not in said


def test_a_cpu_rank_never_offloads_to_free_memory(problem):
    """Where the device is the host, offloading frees nothing: auto searches once, and the
    partitioners count the optimizer state on the device."""
    cpu = replace(problem.hardware, host=replace(problem.hardware.host, device_is_host=True))
    assert searches("auto", cpu.host) == ("none",)
    assert searches("auto", problem.hardware.host) == ("none", "auto")
    assert searches("optimizer", cpu.host) == ("optimizer",)
    on_cpu = replace(problem, hardware=cpu, offload="auto")
    assert on_cpu.gpu_param_split == on_cpu.param_split


def _link_bytes(plan) -> int:
    """Host bytes down per step over every offloaded stage (the simulator's figure)."""
    from ftpipe_compiler.simulate import simulate

    return sum(g.host_bytes_down for g in simulate(plan).gpus)


def test_gradients_sum_on_the_device_when_it_sends_less_and_the_gpu_fits(plan):
    """fp32 with m = 4: the sum (4 B) once against 4 x 4 B streamed: on the device, and the
    host link carries a quarter; a GPU that would not fit with the sums streams them; with
    one micro-batch streaming sends no more, so nothing changes."""
    opt = choose_offload(plan, "optimizer")
    streamed = plan.with_(stages=tuple(replace(s, offload=Offload(optimizer=True))
                                       for s in plan.stages))  # fmt: skip
    assert all(s.offload.sums_on_device for s in opt.stages)
    assert _link_bytes(opt) * plan.micro_batches == _link_bytes(streamed)
    need = {g: streamed.gpu_memory(g) for g in range(plan.gpus)}
    full = max(need, key=need.get)
    tight = plan.with_(memory_bytes=need[full])  # streaming fits exactly: no room for sums
    chosen = choose_offload(tight, "optimizer")
    assert not any(s.offload.sums_on_device for s in chosen.stages_on(full))
    assert all(chosen.gpu_memory(g) <= tight.memory_bytes for g in range(plan.gpus))
    one = choose_offload(plan.with_(micro_batches=1), "optimizer")
    assert not any(s.offload.sums_on_device for s in one.stages)
    replicated = choose_offload(plan.with_(replicas=2, placement=()), "optimizer")
    assert not any(s.offload.sums_on_device for s in replicated.stages)
