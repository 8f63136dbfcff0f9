"""`ftpipe partition` through click's CliRunner."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner
from partition_helpers import crafted_graph

from ftpipe_compiler.cli import cli
from ftpipe_compiler.partition import PARTITIONERS, PATTERNED
from ftpipe_compiler.plan import Plan


@pytest.fixture(scope="module")
def graph_file(tmp_path_factory, tiny_t5_costed):
    path = tmp_path_factory.mktemp("graphs") / "t5-tiny.json"
    tiny_t5_costed.save(path)
    return str(path)


def test_table_lists_every_partitioner_and_writes_the_winner(graph_file, tmp_path):
    out = tmp_path / "plan.json"
    res = CliRunner().invoke(cli, ["partition", graph_file, "--gpus", "2", "-o", str(out)])
    assert res.exit_code == 0, res.output
    for name in PARTITIONERS:
        assert f"\n{name} " in res.output
    assert "lower bound" in res.output
    winner = res.output.strip().splitlines()[-1].split()[1]
    plan = Plan.load(out)
    plan.validate()
    assert plan.partitioner == winner and plan.gpus == 2
    assert plan.optimizer == "adafactor"  # the task's (t5 tiny-t5), not the Problem default
    assert plan.micro_batches == 4  # batch 8 / micro-batch 2
    assert [c["partitioner"] for c in plan.competitors] == list(PARTITIONERS)
    assert plan.command.startswith("ftpipe")


def test_json_output_with_a_subset(graph_file):
    res = CliRunner().invoke(
        cli,
        [
            "partition",
            graph_file,
            "--gpus",
            "2",
            "--json",
            "-p",
            "even-layers,params",
            "--schedule",
            "gpipe",
            "--optimizer",
            "adamw",
            "--micro-batches",
            "6",
        ],
    )
    assert res.exit_code == 0, res.output
    d = json.loads(res.stdout)
    assert set(d) == {"lower_bound_s", "winner", "results"}
    assert [r["partitioner"] for r in d["results"]] == ["even-layers", "params"]
    best = min(d["results"], key=lambda r: (r["period_s"], r["comm_bytes"], r["partitioner"]))
    assert d["winner"] == best["partitioner"]
    assert all(r["period_s"] >= d["lower_bound_s"] * (1 - 1e-9) for r in d["results"])


def test_bad_input_is_one_clear_line(graph_file, tmp_path):
    runner = CliRunner()
    res = runner.invoke(cli, ["partition", graph_file, "--gpus", "2", "-p", "mixed,nope"])
    assert res.exit_code == 2 and "unknown partitioner 'nope'; choose from" in res.output
    assert "Traceback" not in res.output
    res = runner.invoke(cli, ["partition", str(tmp_path / "missing.json"), "--gpus", "2"])
    assert res.exit_code == 1 and "does not exist" in res.output
    res = runner.invoke(
        cli, ["partition", graph_file, "--gpus", "0"]
    )  # a usage error, as compile's
    assert res.exit_code == 2 and "'--gpus' / '-g': 0 is not in the range x>=1" in res.output


def test_infeasible_everywhere_says_what_is_needed(tmp_path):
    # Four layers of 2 GB of weights: 8 GB each with AdamW state, 32 GB in all, so two 11 GiB
    # GPUs cannot hold it and four could, beside each card's reserve and a backward's 2 GB
    # gradient.
    path = tmp_path / "g.json"
    crafted_graph([1e-3] * 4, [2_000_000_000] * 4).save(path)
    res = CliRunner().invoke(
        cli,
        [
            "partition",
            str(path),
            "--gpus",
            "2",
            "--hardware",
            "rtx2080ti",
            "-p",
            "even-layers,mixed,pipedream",
        ],
    )
    assert res.exit_code == 1
    assert "no partitioner found a plan that fits" in res.output
    assert "even-layers: infeasible: needs 4 GPUs / 29.8 GiB" in res.output
    assert "less the device's reserve" in res.output
    res = CliRunner().invoke(
        cli,
        [
            "partition",
            str(path),
            "--gpus",
            "4",
            "--hardware",
            "rtx2080ti",
            "-p",
            "even-layers",
            "--json",
        ],
    )
    assert res.exit_code == 0 and json.loads(res.stdout)["results"][0]["feasible"]


def test_wpipe_plan_from_the_cli_runs_its_schedule(graph_file, tmp_path):
    """Planned for WPipe: two stages per GPU in a loop, from the partitioners that can cut a
    chain; the others say why not; the plan simulates under its schedule."""
    out = tmp_path / "plan.json"
    res = CliRunner().invoke(
        cli, ["partition", graph_file, "--gpus", "2", "--schedule", "wpipe", "-o", str(out)]
    )
    assert res.exit_code == 0, res.output
    assert "mixed: places stages freely, wpipe needs them in a loop" in res.output
    plan = Plan.load(out)
    assert plan.schedule == "wpipe" and plan.partitioner in PATTERNED
    assert [(s.id, s.gpu) for s in plan.stages] == [(0, 0), (1, 1), (2, 0), (3, 1)]
    res = CliRunner().invoke(cli, ["simulate", str(out), "--schedule", "wpipe,2bw,ftpipe"])
    assert res.exit_code == 0, res.output
    assert all(f" {name} " in res.output for name in ("wpipe", "2bw", "ftpipe"))
    assert "cannot run" not in res.output  # a looped plan runs under the free schedules too
