"""Elastic pipelining (PipeTransformer §3.2-3.3): a 4-layer BERT compiled with
`--freeze-training` on 4 CPU ranks freezes 2 layers after step 2 (forced), switches from
one pipeline of 4 GPUs to 2 replicas x 2 GPUs, and goes on; its losses and every weight at
the end equal one process that freezes the same layers after the same step (SGD, as in
test_freeze_training: Adam turns rounding noise on weights of zero gradient into +-lr).
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from runtime_reference import checkpoint_params

transformers = pytest.importorskip("transformers")
from ftpipe_runtime.freeze.layers import bound_schedule, layer_units  # noqa: E402
from runtime_helpers import plan_json  # noqa: E402
from test_freeze_training import CLIP, LR, STEPS, _train_frozen, write_bert  # noqa: E402

from ftpipe_compiler.cli import cli  # noqa: E402

pytestmark = pytest.mark.multiproc


@pytest.fixture(scope="module")
def package(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("elastic")
    write_bert(root / "bert")
    args = ["compile", "--model", str(root / "bert"), "--gpus", "4", "--seq-len", "16",
            "--micro-batch", "2", "--batch", "8", "--schedule", "gpipe", "-p", "even-layers",
            "--freeze-training", "0.5", "-o", str(root / "out")]  # fmt: skip
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 0, result.output
    assert "from 2 frozen layers on 2 replicas x 2 GPUs" in result.output
    return root / "out" / "bert_pipeline"


def test_compile_writes_the_shorter_pipelines(package):
    index = json.loads((package / "elastic" / "index.json").read_text())["plans"]
    main = plan_json(package / "plan.json")
    # one halving per decision of alpha = 1/2 at its fastest: 2, then 3 of 4 layers
    assert [(e["gpus"], e["replicas"], e["micro_batches"], e["frozen_layers"]) for e in index] == [
        (2, 2, 2, bound_schedule(4, 0.5, 1)[-1]),
        (1, 4, 1, bound_schedule(4, 0.5, 2)[-1]),
    ]
    units = layer_units([p["name"] for p in main["params"]])
    for e in index:
        plan = plan_json(package / "elastic" / e["name"] / "plan.json")
        assert (plan["gpus"], plan["replicas"], plan["schedule"]) == (e["gpus"], e["replicas"],
                                                                      "gpipe")  # fmt: skip
        assert (package / "elastic" / e["name"] / "stages.py").is_file()
        owner = {n: s["gpu"] for s in plan["stages"] for n in s["params"]}
        frozen = [n for u in units[: e["frozen_layers"]] for n in u if n in owner]
        assert frozen and {owner[n] for n in frozen} == {0}  # the frozen prefix on GPU 0
        if e["gpus"] > 1:  # a stage of the frozen layers alone: forward only
            assert plan["stages"][0]["forward_only"] and plan["stages"][0]["gpu"] == 0
        # every parameter stays trainable in the code: the run decides what is frozen
        assert [p["trainable"] for p in plan["params"]] == [p["trainable"] for p in main["params"]]


def test_bad_alpha_is_refused(tmp_path):
    result = CliRunner().invoke(
        cli,
        [
            "compile",
            "--model",
            "t5-tiny",
            "--gpus",
            "2",
            "--freeze-training",
            "1.5",
            "-o",
            str(tmp_path / "o"),
        ],  # fmt: skip
    )
    assert result.exit_code == 2 and "--freeze-training" in result.output
    assert not (tmp_path / "o").exists()


def test_switch_to_the_shorter_pipeline_equals_one_process(run_pipeline, package, tmp_path):
    plan = plan_json(package / "plan.json")
    ckpt, log = tmp_path / "ckpt", tmp_path / "run.json"
    argv = ["--steps", str(STEPS), "--optimizer", "sgd", "--lr", str(LR), "--clip", str(CLIP),
            "--schedule", "gpipe", "--device", "cpu", "--freeze-at", "2:2",
            "--save-every", "2", "--checkpoint-dir", str(ckpt), "--log-json", str(log),
            "--log-dir", str(tmp_path / "log")]  # fmt: skip
    env = {"PYTHONPATH": os.pathsep.join([str(package.parent), os.environ.get("PYTHONPATH", "")])}
    codes, ranks = run_pipeline(plan, argv, name="elastic", module=package.name,
                                cwd=package.parent, env=env)  # fmt: skip
    assert codes == [0] * 4, ranks.stderr()
    got = json.loads(log.read_text())
    assert "switching to 2 replicas x 2 GPUs (d2x2)" in ranks.stderr(0)
    segments = [(s["steps"], s["replicas"], s["gpus"]) for s in got["segments"]]
    assert segments == [([0, 2], 1, 4), ([2, STEPS], 2, 2)]
    for s in got["segments"]:  # each segment's step ends, timed from its own start
        ends = s["step_ends_s"]
        assert len(ends) == s["steps"][1] - s["steps"][0] and ends == sorted(ends) and ends[0] > 0
    assert [(f["step"], f["frozen"]) for f in got["freezes"]] == [(2, 2)]
    assert got["replica_difference"] == 0.0

    losses, params, _, _ = _train_frozen(plan, "sgd", freeze_after=2, layers=2)
    assert got["losses"] == pytest.approx(losses, rel=1e-5)
    shrunk = plan_json(package / "elastic" / "d2x2" / "plan.json")
    at_end = checkpoint_params(ckpt / "d2x2", STEPS, range(len(shrunk["stages"])))
    assert set(at_end) >= set(params[-1])
    for name, value in params[-1].items():
        torch.testing.assert_close(at_end[name], value, rtol=1e-5, atol=1e-6, msg=name)
    units = layer_units([p["name"] for p in plan["params"]])
    at_switch = checkpoint_params(ckpt, 2, range(len(plan["stages"])))  # the 4-GPU plan's
    frozen = [n for u in units[:2] for n in u if n in params[1]]
    assert len(frozen) > 10
    for name in frozen:  # moved bit for bit, and not touched after the freeze
        assert torch.equal(at_end[name], at_switch[name]), name


def test_no_shrink_freezes_on_the_same_plan(run_pipeline, package, tmp_path):
    """--no-shrink: the same freeze, the shorter plans in elastic/ left unused."""
    plan = plan_json(package / "plan.json")
    log = tmp_path / "run.json"
    argv = ["--steps", str(STEPS), "--optimizer", "sgd", "--lr", str(LR), "--clip", str(CLIP),
            "--schedule", "gpipe", "--device", "cpu", "--freeze-at", "2:2", "--no-shrink",
            "--checkpoint-dir", str(tmp_path / "ckpt"), "--log-json", str(log)]  # fmt: skip
    env = {"PYTHONPATH": os.pathsep.join([str(package.parent), os.environ.get("PYTHONPATH", "")])}
    codes, ranks = run_pipeline(plan, argv, name="stay", module=package.name,
                                cwd=package.parent, env=env)  # fmt: skip
    assert codes == [0] * 4, ranks.stderr()
    got = json.loads(log.read_text())
    assert [(s["steps"], s["replicas"], s["gpus"]) for s in got["segments"]] == [([0, STEPS], 1, 4)]
    assert [(f["step"], f["frozen"]) for f in got["freezes"]] == [(2, 2)]
    losses, _, _, _ = _train_frozen(plan, "sgd", freeze_after=2, layers=2)
    assert got["losses"] == pytest.approx(losses, rel=1e-5)


def _names_on(plan: dict, rank: int) -> set[str]:
    """The tensors of the stages `plan` puts on `rank` (its state dicts' keys)."""
    placement = plan.get("placement") or [[0, g] for g in range(plan["gpus"])]
    gpu = placement[rank][1]
    return {n for s in plan["stages"] if s["gpu"] == gpu for n in s["params"]}


def test_the_switch_moves_only_each_ranks_new_stages_point_to_point(
    run_pipeline, package, tmp_path
):
    """AdamW, so that state moves too: each rank receives exactly the weights and AdamW state
    of its stages in the shorter plan that it did not hold (the hand-over used to gather
    the whole model and state on every rank), and training goes on as in one process (the
    state arrived with its step: a fresh AdamW would step otherwise)."""
    plan = plan_json(package / "plan.json")
    shrunk = plan_json(package / "elastic" / "d2x2" / "plan.json")
    log = tmp_path / "run.json"
    argv = ["--steps", str(STEPS), "--optimizer", "adamw", "--lr", str(LR), "--clip", str(CLIP),
            "--schedule", "gpipe", "--device", "cpu", "--freeze-at", "2:2",
            "--checkpoint-dir", str(tmp_path / "ckpt"), "--log-json", str(log)]  # fmt: skip
    env = {"PYTHONPATH": os.pathsep.join([str(package.parent), os.environ.get("PYTHONPATH", "")])}
    codes, ranks = run_pipeline(plan, argv, name="adamw", module=package.name,
                                cwd=package.parent, env=env)  # fmt: skip
    assert codes == [0] * 4, ranks.stderr()
    got = json.loads(log.read_text())
    assert [(s["replicas"], s["gpus"]) for s in got["segments"]] == [(1, 4), (2, 2)]

    size = {
        p["name"]: math.prod(p["shape"])
        * torch.empty((), dtype=getattr(torch, p["dtype"])).itemsize
        for p in plan["params"]
    }
    frozen = {n for u in layer_units([p["name"] for p in plan["params"]])[:2] for n in u}
    trained = {p["name"] for p in plan["params"] if p["trainable"]} - frozen

    def bytes_of(names):  # weights, and AdamW's two moments of those still trained
        return sum(size[n] for n in names) + sum(2 * size[n] for n in names & trained)

    want = [bytes_of(_names_on(shrunk, r) - _names_on(plan, r)) for r in range(4)]
    assert got["segments"][0]["handed_over_bytes"] == want
    gathered = [bytes_of(set(size) - _names_on(plan, r)) for r in range(4)]  # all the others'
    assert all(0 < w < g for w, g in zip(want, gathered)), (want, gathered)

    losses, _, _, _ = _train_frozen(plan, "adamw", freeze_after=2, layers=2)
    assert got["losses"] == pytest.approx(losses, rel=1e-5)
    assert got["replica_difference"] == 0.0
