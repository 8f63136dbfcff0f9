"""`ftpipe compile` on a cluster: the planner's choice, `--replicas` fixing the width."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from ftpipe_compiler.cli import cli
from ftpipe_compiler.plan import Plan

BASE = ["compile", "--model", "t5-tiny", "--hardware", "cpu", "--batch", "16", "--json"]


def _compile(tmp_path, *extra):
    out = tmp_path / "out"
    r = CliRunner().invoke(cli, [*BASE, "-o", str(out), *extra])
    assert r.exit_code == 0, r.output
    return json.loads(r.output[r.output.index("{") :]), Plan.load(out / "plan.json")


def test_the_planner_chooses_a_shape_and_reports_it(tmp_path):
    data, plan = _compile(tmp_path, "--gpus", "4", "--gpus-per-node", "2")
    planner = data["planner"]
    assert (data["replicas"], data["gpus_per_replica"]) == (plan.replicas, plan.gpus)
    assert plan.replicas * plan.gpus == 4 == plan.world and plan.cluster.gpus_per_node == 2
    shapes = {(c["replicas"], c["gpus"]) for c in planner["candidates"]}
    assert shapes == {(1, 4), (2, 2), (4, 1)}
    # Every candidate trains the same global batch; the chosen one is the fastest simulated
    # and no pruned candidate's bound beats it by more than the planner's gap.
    for c in planner["candidates"]:
        assert c["replicas"] * c["micro_batches"] * c["micro_batch"] == 16
    chosen = next(c for c in planner["candidates"] if c["status"] == "chosen")
    simulated = [c["samples_per_s"] for c in planner["candidates"] if c["status"] == "simulated"]
    assert all(chosen["samples_per_s"] >= s for s in simulated)
    pruned = [c["bound"] for c in planner["candidates"] if c["status"] == "pruned"]
    assert all(b <= chosen["samples_per_s"] * 1.05 for b in pruned)
    # the plan kept is simulated again (`kept_sim`): the search's figure to rounding
    assert chosen["samples_per_s"] == pytest.approx(data["simulated"]["samples_per_s"], rel=1e-9)
    assert [tuple(x) for x in planner["placement"]] == list(plan.placed())


def test_replicas_fix_the_width(tmp_path):
    data, plan = _compile(tmp_path, "--gpus", "4", "--replicas", "2")
    assert (plan.replicas, plan.gpus, data["planner"]["gpus_per_replica"]) == (2, 2, 2)
    assert {c["replicas"] for c in data["planner"]["candidates"]} == {2}


def test_one_replica_is_the_single_pipeline(tmp_path):
    """--replicas 1 plans one pipeline of all the GPUs, as compile without a cluster does."""
    # rtx2080ti: its node's link is the pipeline's link (cpu's gloo figure is its own).
    hw = ["--hardware", "rtx2080ti"]
    data, plan = _compile(tmp_path, "--gpus", "2", "--replicas", "1", *hw)
    single = CliRunner().invoke(cli, [*BASE, "--gpus", "2", "-o", str(tmp_path / "single"), *hw])
    assert single.exit_code == 0, single.output
    alone = Plan.load(tmp_path / "single" / "plan.json")
    assert (plan.replicas, plan.gpus, plan.placed()) == (1, 2, ((0, 0), (0, 1)))
    assert plan.period_s <= alone.period_s * 1.0001  # the planner also tries keeping activations


def test_a_batch_that_leaves_shapes_out_says_which_and_the_batch_that_does_not():
    from ftpipe_compiler.cli.cluster import batch_note
    from ftpipe_compiler.costs.cluster import get_cluster
    from ftpipe_compiler.planner.search import Space, candidates

    cluster = get_cluster("v100-32gb", 64, 8)
    note = batch_note(cluster, 40, 4, chosen=2)
    assert "for 1 and 2 replicas, so 4, 8, 16, 32 and 64 replicas were not tried" in note
    assert "--batch 256 " in note
    # what the note says is what the planner's candidates are, before and after
    widths = {c.replicas for c in candidates(cluster, Space(batch=40), (4,))}
    assert widths == {1, 2}
    widths = {c.replicas for c in candidates(cluster, Space(batch=256), (4,))}
    assert widths == {1, 2, 4, 8, 16, 32, 64}
    assert batch_note(cluster, 256, 4, chosen=4) is None  # every width tried
    # 640 leaves out 64 replicas of 1 GPU, but the planner chose 4 of the 32 it could have
    assert batch_note(cluster, 640, 4, chosen=4) is None
    assert batch_note(cluster, 40, 4, chosen=1) is None


def test_the_note_is_printed_under_the_shapes_unless_the_shapes_are_fixed(tmp_path):
    args = ["compile", "--model", "t5-tiny", "--hardware", "cpu", "--gpus", "4",
            "--gpus-per-node", "2", "--batch", "8", "--micro-batch", "4"]  # fmt: skip
    r = CliRunner().invoke(cli, [*args, "-o", str(tmp_path / "a")])
    assert r.exit_code == 0, r.output
    assert "for 1 and 2 replicas, so 4 replicas were not tried; --batch 16 " in r.output
    assert r.output.index("note: ") < r.output.index("chosen: ")
    r = CliRunner().invoke(cli, [*args, "--replicas", "2", "-o", str(tmp_path / "b")])
    assert r.exit_code == 0, r.output
    assert "note: " not in r.output
    data, _ = _compile(tmp_path, "--gpus", "4", "--gpus-per-node", "2", "--micro-batch", "8")
    assert data["batch_note"].startswith("note: a batch of 16 sequences")
