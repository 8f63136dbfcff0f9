import json
import re

import pytest
from click.testing import CliRunner

from ftpipe_compiler.cli import cli
from ftpipe_compiler.codegen import check_package
from ftpipe_compiler.partition import PARTITIONERS
from ftpipe_compiler.plan import Plan
from ftpipe_compiler.planner.matrix import schedule_names, update_rule

SCHEDULES = tuple(schedule_names("auto"))
SYNC = tuple(schedule_names("sync"))


def test_compile_writes_plan_report_and_package(tmp_path):
    out = tmp_path / "out"
    r = CliRunner().invoke(
        cli,
        [
            "compile",
            "--model",
            "t5-tiny",
            "--gpus",
            "2",
            "--schedule",
            "ftpipe",
            "-o",
            str(out),
            "--json",
        ],
    )
    assert r.exit_code == 0, r.output
    data = json.loads(r.output[r.output.index("{") :])
    assert data["winner"] in {row["partitioner"] for row in data["results"]}
    assert {row["partitioner"] for row in data["results"]} == {
        "mixed",
        "pipedream",
        "acyclic",
        "metis",
        "even-layers",
        "params",
    }
    # The winner is the fastest plan by simulation among those that fit.
    feasible = [row for row in data["results"] if row["status"] == "ok"]
    fastest = min(row["simulated_step_time_s"] for row in feasible)
    winner = next(row for row in data["results"] if row["partitioner"] == data["winner"])
    assert winner["simulated_step_time_s"] == fastest
    plan = Plan.load(out / "plan.json")
    assert plan.partitioner == data["winner"] and len(plan.competitors) == 6
    assert plan.schedule == data["schedule"] == "ftpipe"
    assert plan.simulated["step_time_s"] == data["simulated"]["step_time_s"]
    assert "ftpipe compile --model t5-tiny" in plan.command
    assert (out / "report.html").read_text().count("<svg") >= 1
    pkg = out / "t5_tiny_pipeline"
    assert (pkg / "stages.py").exists() and (pkg / "__main__.py").exists()
    assert "ftpipe compile --model t5-tiny" in (pkg / "stages.py").read_text()[:500]
    # One plan: what `ftpipe simulate out/plan.json` reads is what the package runs.
    assert (out / "plan.json").read_bytes() == (pkg / "plan.json").read_bytes()
    # ... and it says of the plan what the compile said: the same steps simulated (a search
    # simulates as few as show the steady state; T5-3B in bf16 read 60.86 against 60.89
    # samples/s when `simulate` took 10 steps whatever the compile's)
    r = CliRunner().invoke(cli, ["simulate", str(out / "plan.json"), "--json"])
    assert r.exit_code == 0, r.output
    said = json.loads(r.output)
    assert said["steps"] == plan.simulated["steps"] >= 2
    for key in ("step_time_s", "samples_per_s", "bubble_fraction"):
        assert said[key] == plan.simulated[key], key


@pytest.mark.parametrize(
    ("spec", "expect"), [("auto", SCHEDULES), ("sync", SYNC), ("1f1b,zb1p", ("1f1b", "zb1p"))]
)
def test_compile_picks_partition_and_schedule_together(tmp_path, spec, expect):
    out = tmp_path / "out"
    argv = ["compile", "-m", "gpt2-tiny", "--gpus", "2", "-o", str(out), "--json"]
    r = CliRunner().invoke(cli, argv if spec == "auto" else [*argv, "--schedule", spec])
    assert r.exit_code == 0, r.output
    data = json.loads(r.output[r.output.index("{") :])
    rows = data["results"]
    # Every (schedule, partitioner) cell is in the matrix, with figures or a reason.
    assert [(row["schedule"], row["partitioner"]) for row in rows] == [
        (s, p) for s in expect for p in PARTITIONERS
    ]
    assert all(row["note"] for row in rows if row["status"] != "ok")
    ok = [row for row in rows if row["status"] == "ok"]
    assert {row["schedule"] for row in ok} == set(expect)  # every schedule has a plan here
    fastest = min(ok, key=lambda row: row["simulated_step_time_s"])
    assert (data["schedule"], data["winner"]) == (fastest["schedule"], fastest["partitioner"])
    plan = Plan.load(out / "plan.json")
    assert (plan.schedule, plan.partitioner) == (data["schedule"], data["winner"])
    assert len(plan.competitors) == len(rows)
    # Whether the winner trains like one process, and the best plan that does.
    assert data["update"] == update_rule(data["schedule"]) == fastest["update"]
    exact = min((r for r in ok if r["update"] == "sync"), key=lambda r: r["simulated_step_time_s"])
    assert (data["best_sync"]["schedule"], data["best_sync"]["partitioner"]) == (
        exact["schedule"],
        exact["partitioner"],
    )
    report = (out / "report.html").read_text()
    assert "partitioner × schedule" in report and report.count("<tr>") > len(rows)


def test_winner_line_says_how_the_schedule_updates(tmp_path):
    """An asynchronous winner says so, and what the best synchronous plan gives; a
    synchronous winner says it trains as one process would."""
    argv = ["compile", "-m", "gpt2-tiny", "--gpus", "2", "-p", "even-layers,pipedream"]
    r = CliRunner().invoke(cli, [*argv, "--schedule", "ftpipe,1f1b", "-o", str(tmp_path / "a")])
    assert r.exit_code == 0, r.output
    # Not a terminal: no bar, a line per phase with its time (as in `> log.txt 2>&1`).
    phases = [
        re.fullmatch(r"compile: (.+) \((\d+\.\d) s\)", line) for line in r.stderr.splitlines()
    ]
    assert [m and m[1] for m in phases] == [
        "trace and profile",
        "partition x schedule, simulated",
        "generate",
    ]
    winner = next(line for line in r.output.splitlines() if line.startswith("winner:"))
    assert "under ftpipe" in winner and winner.endswith(
        "asynchronous: some stages train on stale weights, unlike one process"
    )
    plan = Plan.load(tmp_path / "a" / "plan.json")
    sync = [c for c in plan.competitors if c["schedule"] == "1f1b" and c["status"] == "ok"]
    exact = min(sync, key=lambda c: c["simulated_step_time_s"])
    slower = exact["simulated_step_time_s"] / plan.simulated["step_time_s"] - 1
    assert (
        f"  best synchronous plan: {exact['partitioner']} under 1f1b, "
        f"{exact['simulated_samples_per_s']:.2f} samples/s ({slower:.0%} slower per step); "
        "--schedule sync plans only the synchronous schedules"
    ) in r.output.splitlines()
    r = CliRunner().invoke(cli, [*argv, "--schedule", "sync", "-o", str(tmp_path / "s")])
    assert r.exit_code == 0, r.output
    assert "synchronous: it trains exactly as one process would" in r.output
    assert "best synchronous plan" not in r.output
    assert update_rule(Plan.load(tmp_path / "s" / "plan.json").schedule) == "sync"


def test_compile_refuses_to_overwrite_without_force(tmp_path):
    out = tmp_path / "out"
    args = ["compile", "--model", "gpt2-tiny", "--gpus", "2", "-o", str(out), "-p", "even-layers"]
    assert CliRunner().invoke(cli, args).exit_code == 0
    before = {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file()}
    r = CliRunner().invoke(cli, args)
    assert r.exit_code == 1
    assert "already exists; pass --force" in r.output and "Traceback" not in r.output
    after = {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file()}
    assert after == before
    r = CliRunner().invoke(cli, [*args[:-1], "params", "--force"])
    assert r.exit_code == 0, r.output
    assert Plan.load(out / "plan.json").partitioner == "params"
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temp folders left


def test_compile_failure_leaves_existing_output(tmp_path):
    out = tmp_path / "out"
    assert (
        CliRunner()
        .invoke(
            cli,
            ["compile", "--model", "gpt2-tiny", "--gpus", "2", "-o", str(out), "-p", "even-layers"],
        )
        .exit_code
        == 0
    )
    before = (out / "plan.json").read_bytes()
    r = CliRunner().invoke(
        cli,
        ["compile", "--model", "gpt2-tiny", "--gpus", "2", "-o", str(out), "-t", "nope", "--force"],
    )
    assert r.exit_code == 1 and "unknown task 'nope'" in r.output
    assert (out / "plan.json").read_bytes() == before


@pytest.mark.parametrize("head", ["masked-lm", "sequence-classification", "token-classification"])
def test_compile_other_heads_and_check(tmp_path, head):
    """The head is an option: BERT compiled with three more heads computes what they compute."""
    out = tmp_path / head
    args = ["compile", "--model", "bert-tiny", "--head", head, "--gpus", "2", "--seq-len", "16"]
    args += ["--micro-batch", "2", "--batch", "4", "-p", "even-layers,pipedream", "-o", str(out)]
    r = CliRunner().invoke(cli, args)
    assert r.exit_code == 0, r.output
    result = check_package(out / "bert_tiny_pipeline")
    assert result.ok and result.loss_rel_diff <= 1e-5, result


def test_a_slow_plan_prints_its_samples_per_second(tmp_path):
    """GPT-2 planned for CPUs trains well under one sample a second: every rate printed (the
    table, the winner, the best synchronous plan, simulate, its comparison, the cluster's
    shapes) has three significant figures, not "0.00"."""
    small = r"0\.000\d\d\d"  # 0.000399 ...: three significant figures
    argv = ["compile", "-m", "gpt2", "-g", "2", "--hardware", "cpu", "--dtype", "bf16"]
    argv += ["-p", "even-layers", "--schedule", "gpipe,ftpipe", "-o", str(tmp_path / "a")]
    r = CliRunner().invoke(cli, argv)
    assert r.exit_code == 0, r.output
    assert " 0.00 " not in r.output and "0.00 samples/s" not in r.output, r.output
    rows = [line for line in r.output.splitlines() if re.match(r"\w+ +\w+ +even-layers ", line)]
    assert len(rows) == 2 and all(re.search(f" {small} ", row) for row in rows), rows
    assert re.search(f"winner: .*\\(2 stages, {small} samples/s simulated", r.output), r.output
    assert re.search(f"best synchronous plan: .*, {small} samples/s \\(", r.output), r.output
    plan = str(tmp_path / "a" / "plan.json")
    r = CliRunner().invoke(cli, ["simulate", plan])
    assert r.exit_code == 0 and re.search(f"\n  samples/s +{small}\n", r.output), r.output
    r = CliRunner().invoke(cli, ["simulate", plan, "--schedule", "gpipe,ftpipe"])
    assert r.exit_code == 0 and len(re.findall(f" 2 +{small} ", r.output)) == 2, r.output
    argv = ["compile", "-m", "gpt2", "-g", "4", "--gpus-per-node", "2", "--hardware", "cpu"]
    r = CliRunner().invoke(cli, [*argv, "-p", "even-layers", "--schedule", "gpipe",
                                 "-o", str(tmp_path / "c")])  # fmt: skip
    assert r.exit_code == 0, r.output
    chosen = next(line for line in r.output.splitlines() if " chosen " in line)
    assert re.search(r" chosen +0\.0\d\d\d +0\.0\d\d\d ", chosen), chosen
