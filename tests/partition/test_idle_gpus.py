"""More GPUs than the model can use: plans stay on the GPUs they use (the runtime refuses a
plan that gives a GPU nothing to run: tests/runtime/job/test_runtime_bad_input.py). METIS's C notes
stay off stdout at many GPUs."""

from __future__ import annotations

import json
import random

import pytest
from click.testing import CliRunner
from ftpipe_runtime.spec.topology import Topology
from partition_helpers import make_graph, make_problem
from test_assignment import random_assignment

from ftpipe_compiler.cli import cli
from ftpipe_compiler.partition import build_plan, run_partitioners
from ftpipe_compiler.partition.indexed import NodeCosts
from ftpipe_compiler.plan import Plan


def test_a_one_node_model_compiles_for_the_one_gpu_it_can_use(tmp_path):
    out = tmp_path / "o"
    argv = ["compile", "-m", "zoo_fixtures:one_node_model", "--gpus", "4", "-o", str(out)]
    r = CliRunner().invoke(cli, argv)
    assert r.exit_code == 0, r.output
    assert "the best plan uses 1 of the 4 GPUs asked for" in r.output
    assert "torchrun --nproc_per_node 1 -m zoo_fixtures_pipeline" in r.output
    assert Plan.load(out / "plan.json").gpus == 1
    package_plan = json.loads((out / "zoo_fixtures_pipeline" / "plan.json").read_text())
    Topology(package_plan)  # what the runtime checks: every rank has a stage


def test_compaction_renumbers_gpus_and_keeps_every_figure():
    rng = random.Random(3)
    graph = make_graph(30, 3)
    problem = make_problem(graph, gpus=6, memory=2**50)
    lay = random_assignment(NodeCosts.of(problem), rng, 6)
    plan = build_plan(problem, lay.stage_of(), lay.gpu_of(), "test")
    assert plan.idle_gpus  # this layout leaves some GPUs without a stage
    compact = plan.compacted()
    used = sorted({s.gpu for s in plan.stages})
    assert compact.gpus == len(used) and not compact.idle_gpus
    assert [used[s.gpu] for s in compact.stages] == [s.gpu for s in plan.stages]
    assert compact.period_s == pytest.approx(plan.period_s, rel=1e-12)
    assert compact.comm_bytes == plan.comm_bytes
    assert [compact.gpu_memory(g) for g in range(compact.gpus)] == [
        plan.gpu_memory(g) for g in used
    ]
    compact.validate()


def test_every_partitioner_result_uses_all_its_gpus():
    graph = make_graph(6, 1)
    problem = make_problem(graph, gpus=16, memory=2**50)
    for r in run_partitioners(problem, progress=False):
        if r.plan is not None:
            assert not r.plan.idle_gpus and r.plan.gpus <= 6, r.partitioner


def test_metis_notes_do_not_reach_stdout_at_64_gpus(tiny_t5_costed, tmp_path, capfd):
    path = tmp_path / "g.json"
    tiny_t5_costed.save(path)
    capfd.readouterr()
    r = CliRunner().invoke(cli, ["partition", str(path), "--gpus", "64", "-p", "metis", "--json"])
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["winner"] == "metis"
    assert "Cannot bisect" not in capfd.readouterr().out  # fd 1, where C's printf writes
