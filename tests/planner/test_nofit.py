"""When nothing fits: one sentence of what training needs, what there is, and which options
would fit, each figure against its formula and the GPU count against the planner."""

from __future__ import annotations

import json
import math
import re
from dataclasses import replace

import pytest
from click.testing import CliRunner

from ftpipe_compiler.cli import cli
from ftpipe_compiler.costs.formulas import MemoryReserve
from ftpipe_compiler.errors import InfeasibleError
from ftpipe_compiler.partition import problem_from_graph
from ftpipe_compiler.planner import nofit
from ftpipe_compiler.planner.matrix import NothingFits, search_matrix
from ftpipe_compiler.planner.nofit import check_floor, explain
from ftpipe_compiler.units import size


@pytest.fixture(scope="module")
def problem(tiny_t5_costed):
    # Without the device's reserve (hundreds of MB), so that the test's few KB are all there is.
    p = problem_from_graph(tiny_t5_costed, 2, "rtx2080ti", "1f1b", "adamw", 4)
    return replace(p, hardware=replace(p.hardware, memory_reserve=MemoryReserve()))


def _overhead(problem) -> int:
    """What a GPU keeps for the runtime beside the stages (the largest gradient before it is
    added in, the receive buffers posted ahead: `Problem.memory`), so that a test's capacity
    leaves the stages exactly the bytes it means."""
    return problem.capacity - problem.memory


def _numel(graph) -> int:
    return sum(math.prod(p.shape) for p in graph.params if p.trainable)


def _fits_on(problem, gpus: int) -> bool:
    """Does any plan of the chain partitioner fit on `gpus` under 1f1b (the planner's word)?"""
    try:
        search_matrix(replace(problem, gpus=gpus), ["1f1b"], ["pipedream"], workers=1)
    except NothingFits:
        return False
    return True


@pytest.fixture(autouse=True)
def _fewer_gpus_tried(monkeypatch):
    """A count of GPUs is searched up to 16, not 256: each try plans the tiny model."""
    monkeypatch.setattr(nofit, "MAX_GPUS", 16)


def test_the_weights_alone_do_not_fit(problem):
    """fp32 AdamW: 4 B weight + 4 B gradient + 8 B of moments = 16 B per parameter; the
    GPUs hold less than that together, so no partitioner runs and the sentence says why."""
    numel = _numel(problem.graph)
    floor = 16 * numel
    assert floor == sum(problem.static_bytes.values())  # tiny T5: every parameter trains
    small = replace(problem, memory_bytes=int(floor / 2 * 0.8) + _overhead(problem))
    with pytest.raises(InfeasibleError) as e:
        check_floor(small, "t5-tiny", ["1f1b"], steps=4)
    said = str(e.value)
    count = f"{numel / 1e6:.3g} million" if numel >= 1e6 else f"{numel / 1e3:.3g} thousand"
    assert said.startswith(
        f"t5-tiny needs {size(floor)} for its weights, gradients and optimizer state "
        f"({count} trainable parameters x 16 B: 4 B weight + 4 B gradient + "
        f"2 x 4 B adamw state in fp32), {size(floor / 2)} per GPU on 2 before any activation, "
        f"more than one rtx2080ti's {size(small.memory)} ({size(small.capacity)} less the "
        "device's reserve); would fit: "
    )
    # More GPUs: the fewest the planner finds (a GPU with two neighbours posts more messages,
    # which at this tiny size may leave no count that fits).
    found = re.search(r"--gpus (\d+) \(checked: a plan under 1f1b fits\)", said)
    if found:
        n = int(found[1])
        assert _fits_on(small, n) and not _fits_on(small, n - 1)
    else:
        assert f"no GPU count up to {nofit.MAX_GPUS}" in said and not _fits_on(small, 3)
    # bf16-pure: 2 B weight + 2 B gradient + 2 x 2 B moments; LoRA: the frozen fp32 weights.
    assert f"--dtype bf16-pure ({size(8 * numel)}: " in said
    assert (
        f"--lora r=16,alpha=32,targets=q,k,v,o,wi,wo ({size(4 * numel)} plus the adapters: "
        "within these 2 GPUs before activations)"
    ) in said
    assert "\n" not in said and said.count("needs") == 1 and "infeasible" not in said


def test_the_activations_do_not_fit(problem):
    """The weights fit together but no split fits with its activations: the search runs,
    and the sentence gives the closest plan and the GPU count that fits."""
    floor = sum(problem.static_bytes.values())
    tight = replace(problem, memory_bytes=int(floor / 2 * 1.05) + _overhead(problem))
    check_floor(tight, "t5-tiny", ["1f1b"])  # the floor fits: no error before the search
    with pytest.raises(NothingFits) as e:
        search_matrix(tight, ["1f1b"], workers=1)
    said = str(explain(tight, "t5-tiny", ["1f1b"], e.value.matrix, steps=4))
    assert (
        f"within one rtx2080ti's {size(tight.memory)} ({size(tight.capacity)} less the device's "
        "reserve), but no split of it fits" in said
    )
    simulated = [c.sim.max_memory_bytes for c in e.value.matrix if c.sim is not None]
    if simulated:  # a plan that the simulation found too big: how big
        assert f"the closest plan needs {size(min(simulated))} on its fullest GPU" in said
    else:  # every partitioner saw it would not fit
        assert "closest" not in said
    found = re.search(r"--gpus (\d+) \(checked", said)
    if found:
        n = int(found[1])
        assert n > 2 and _fits_on(tight, n) and not _fits_on(tight, n - 1)
    else:
        assert f"no GPU count up to {nofit.MAX_GPUS}" in said and not _fits_on(tight, 3)
    assert "a smaller --micro-batch or --seq-len" in said


def test_compile_says_it_once(tmp_path, monkeypatch):
    """`ftpipe compile --offload none` of 2.15 B parameters (traced on the meta device) on
    2 x 11 GiB: one line, no partitioner's or schedule's reason repeated (it was ~2,900
    characters); host offload, which would fit (4 B of fp32 weight per parameter on the GPUs,
    20 B on the host), among the options."""
    monkeypatch.syspath_prepend(str(__import__("pathlib").Path(__file__).parents[1]))
    r = CliRunner().invoke(cli, ["compile", "-m", "zoo_fixtures:wide_model", "-g", "2",
                                 "--hardware", "rtx2080ti", "--offload", "none",
                                 "-o", str(tmp_path / "o")])  # fmt: skip
    assert r.exit_code == 1 and "Traceback" not in r.output
    said = r.stderr.splitlines()[-1]
    assert said.startswith("Error: zoo_fixtures needs 32.0 GiB for its weights") and len(said) < 700
    assert re.search(
        r"16.0 GiB per GPU on 2 before any activation, more than one rtx2080ti's "
        r"[\d.]+ GiB \(11.0 GiB less the device's reserve\)",
        said,
    ), said
    assert (
        "--gpus 4 (checked" in said and "--dtype bf16-pure (16.0 GiB: within these 2 GPUs" in said
    )
    assert re.search(
        r"--offload auto \(checked: a plan under \w+ fits with the optimizer state of 2 stages "
        r"on the host\)",
        said,
    ), said
    assert "compile: partition" not in r.stderr  # no partitioner ran
    assert not (tmp_path / "o").exists()


def test_compile_offloads_only_when_nothing_fits_without(tmp_path, monkeypatch):
    """The same model with the default --offload auto compiles: nothing fits on the GPUs
    alone, so both stages keep their fp32 optimizer state on the host, each said with the
    memory its GPU would need without; the plan records it per stage."""
    monkeypatch.syspath_prepend(str(__import__("pathlib").Path(__file__).parents[1]))
    out = tmp_path / "o"
    r = CliRunner().invoke(cli, ["compile", "-m", "zoo_fixtures:wide_model", "-g", "2",
                                 "--hardware", "rtx2080ti", "--schedule", "1f1b,ftpipe",
                                 "-p", "pipedream", "-o", str(out)])  # fmt: skip
    assert r.exit_code == 0, r.output
    for g in (0, 1):
        assert re.search(
            rf"stage \d \(GPU {g}\) offloads its optimizer state( \([^)]*\))?: GPU {g} would "
            r"need [\d.]+ GiB "
            r"of its 11.0 GiB without offload",
            r.output,
        ), r.output
    plan = json.loads((out / "plan.json").read_text())
    assert all(
        s["offload"]["optimizer"] and not s["offload"]["activations"] for s in plan["stages"]
    )
    assert plan["model"]["offload"] == "auto" and plan["summary"]["feasible"]
