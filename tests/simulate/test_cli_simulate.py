"""`ftpipe simulate`: the table, --json, --report, and one sentence for a bad plan file."""

from __future__ import annotations

import json
import re

import pytest
from click.testing import CliRunner

from ftpipe_compiler.cli import cli
from ftpipe_compiler.units import size


def run(*args):
    return CliRunner().invoke(cli, ["simulate", *map(str, args)])


def test_table_json_and_report(plan_factory, tmp_path):
    path = tmp_path / "plan.json"
    plan = plan_factory([(1.0, 2.0, 1.0)] * 3, gpu_of=[0, 1, 0], micro_batches=4)
    plan.save(path)
    r = run(path, "--steps", 4)
    assert r.exit_code == 0, r.output
    assert "step time" in r.output and "samples/s" in r.output and "bubble" in r.output
    rows = [line.split() for line in r.output.splitlines() if line.strip()[:1].isdigit()]
    assert [row[0] for row in rows] == ["0", "1"] and rows[0][-2:] == ["0,", "2"]

    r = run(path, "--json", "--schedule", "gpipe", "--micro-batches", 2, "--steps", 3)
    data = json.loads(r.output)
    assert {"step_time_s", "samples_per_s", "bubble_fraction", "gpus"} <= set(data)
    # GPipe, 3 equal stages (F 1, B 2, recompute 1), 2 micro-batches: (2 + 3 - 1) x 4 s if
    # every stage recomputed; the loss stage keeps its activations, which saves 1 s.
    assert data["step_time_s"] == 15.0
    assert [g["stages"] for g in data["gpus"]] == [[0, 2], [1]]
    assert {"gpu", "busy_fraction", "peak_memory_bytes", "stages"} <= set(data["gpus"][0])

    report = tmp_path / "out" / "report.html"
    report.parent.mkdir()
    r = run(path, "--report", report)
    assert r.exit_code == 0 and report.exists() and "<svg" in report.read_text()
    assert f"--report {report}" in report.read_text()


def test_bad_plan_files_get_one_sentence(plan_factory, tmp_path):
    good = tmp_path / "plan.json"
    plan_factory([(1.0, 2.0, 1.0)] * 2).save(good)
    truncated = tmp_path / "truncated.json"
    truncated.write_text(good.read_text()[:200])
    old = tmp_path / "old.json"
    old.write_text(json.dumps({**json.loads(good.read_text()), "format": 0, "version": "0.0.1"}))
    cases = [
        (tmp_path / "missing.json", "does not exist"),
        (truncated, "is not valid JSON"),
        (old, "plan format 0 was written by ftpipe 0.0.1"),
    ]
    for path, message in cases:
        r = run(path)
        assert r.exit_code == 1, r.output
        assert message in r.output and "Traceback" not in r.output
        assert len(r.output.strip().splitlines()) == 1


def test_report_to_an_unwritable_place(plan_factory, tmp_path):
    good = tmp_path / "plan.json"
    plan_factory([(1.0, 2.0, 1.0)] * 2).save(good)
    r = run(good, "--report", tmp_path / "no" / "such" / "dir" / "r.html")
    assert (
        r.exit_code == 1 and "cannot write the report" in r.output and "Traceback" not in r.output
    )


def test_schedules_side_by_side(plan_factory, tmp_path):
    path = tmp_path / "plan.json"
    # Recompute costs nothing: every backward takes 3 s, recomputing or not (GPipe's loss stage).
    plan_factory([(1.0, 3.0, 0.0)] * 3, micro_batches=4).save(path)
    r = run(path, "--schedule", "gpipe,1f1b,2bw,ftpipe,wpipe", "--steps", 4, "--json")
    assert r.exit_code == 0, r.output
    rows = {row["schedule"]: row for row in json.loads(r.output)}
    assert list(rows) == ["gpipe", "1f1b", "2bw", "ftpipe", "wpipe"]
    assert rows["gpipe"]["step_time_s"] == 4.0 * (4 + 3 - 1)  # GPipe's bubble: (K-1)/(M+K-1)
    assert rows["2bw"]["step_time_s"] == rows["ftpipe"]["step_time_s"] == 4.0 * 4  # no flush
    assert rows["2bw"]["max_memory_bytes"] > rows["1f1b"]["max_memory_bytes"]  # 2nd version
    assert "wpipe needs 6 stages placed in a loop" in rows["wpipe"]["error"]
    assert not rows["wpipe"]["fits"] and rows["gpipe"]["fits"]
    table = run(path, "--schedule", "gpipe,wpipe", "--steps", 4)
    assert table.exit_code == 0 and "samples/s" in table.output
    assert "wpipe" in table.output and "cannot run: wpipe needs" in table.output


def test_plans_side_by_side(plan_factory, tmp_path):
    free, looped = tmp_path / "free.json", tmp_path / "looped.json"
    plan_factory([(1.0, 2.0, 1.0)] * 2, schedule="2bw", micro_batches=4).save(free)
    halves = [(0.5, 1.0, 0.5)] * 4
    plan_factory(halves, gpu_of=[0, 1, 0, 1], schedule="wpipe", micro_batches=4).save(looped)
    r = run(free, looped, "--steps", 6, "--json")
    assert r.exit_code == 0, r.output
    rows = json.loads(r.output)
    assert [(row["label"], row["schedule"], row["stages"]) for row in rows] == [
        (str(free), "2bw", 2),
        (str(looped), "wpipe", 4),
    ]
    assert all(row["fits"] and row["samples_per_s"] > 0 for row in rows)
    r = run(free, looped, "--report", tmp_path / "r.html")
    assert r.exit_code == 2 and "--report draws one plan under one schedule" in r.output
    r = run(free, "--schedule", "2bw,zigzag")
    assert r.exit_code == 2 and "unknown schedule 'zigzag'; choose from gpipe" in r.output


def test_a_csv_schedule_simulates_and_a_bad_one_is_refused(plan_factory, tmp_path):
    from ftpipe_runtime.schedules import actions, write_lists

    path = tmp_path / "plan.json"
    plan = plan_factory([(1.0, 3.0, 0.0)] * 3, schedule="gpipe", micro_batches=4)
    plan.save(path)
    mine = tmp_path / "mine.csv"
    write_lists(actions("gpipe", plan.stage_infos(), 4, 1), mine)
    r = run(path, "--schedule", mine, "--steps", 3, "--json")
    assert r.exit_code == 0, r.output
    assert json.loads(r.output)["step_time_s"] == 4.0 * (4 + 3 - 1)  # the same as gpipe's
    skipped = tmp_path / "skipped.csv"
    skipped.write_text(mine.read_text().replace("1F2,", ""))
    r = run(path, "--schedule", skipped)
    assert r.exit_code == 1 and "Traceback" not in r.output
    assert "1F2 is missing: stage 1 never runs its forward of micro-batch 2" in r.output
    stuck = tmp_path / "stuck.csv"
    rows = mine.read_text().splitlines()
    rows[0] = "0F0,0R0,0F1,0F2,0F3,0R3,0R2,0R1,0S0"  # a backward before the others' forwards
    stuck.write_text("\n".join(rows) + "\n")
    r = run(path, "--schedule", stuck)
    assert r.exit_code == 1, r.output
    assert "these action lists deadlock: GPU 0 at 0R0 waits for 1B0; GPU 1 at 1F1" in r.output


def _trace_of(result, plan) -> dict:
    """A trace as the package writes it, of a run that went exactly as simulated."""
    rows = {g: [] for g in range(plan.gpus)}
    for e in result.timeline:
        rows[e.gpu].append([e.kind, e.stage, e.mb, e.start, e.end, 0.0])
    return {
        "kind": "ftpipe-trace",
        "format": 1,
        "schedule": result.schedule,
        "micro_batches": result.micro_batches,
        "steps": 3,
        "first": 0,
        "ranks": [{"rank": g, "gpu": g, "replica": 0, "actions": r} for g, r in rows.items()],
    }


def test_compare_sets_a_run_beside_the_simulation(plan_factory, tmp_path):
    from ftpipe_compiler.simulate import simulate

    path, trace, report = tmp_path / "plan.json", tmp_path / "trace.json", tmp_path / "r.html"
    plan = plan_factory([(1.0, 3.0, 0.0)] * 3, schedule="1f1b", micro_batches=4)
    plan.save(path)
    # A run that went as simulated (the simulation's first 3 steps): 0% off.
    trace.write_text(json.dumps(_trace_of(simulate(plan, "gpipe", steps=3), plan)))
    r = run(path, "--compare", trace, "--json")
    assert r.exit_code == 0, r.output
    data = json.loads(r.output)
    assert data["schedule"] == "gpipe" and data["measured"]["steps"] == 3  # the trace's
    assert data["error"] == 0.0 or abs(data["error"]) < 1e-12
    assert data["measured"]["step_time_s"] == data["step_time_s"]
    # A run twice as slow: the simulation is 50% under it, in words and in the report.
    slow = _trace_of(simulate(plan, "gpipe", steps=3), plan)
    for rank in slow["ranks"]:
        rank["actions"] = [[k, s, mb, 2 * a, 2 * b, w] for k, s, mb, a, b, w in rank["actions"]]
    trace.write_text(json.dumps(slow))
    r = run(path, "--compare", trace, "--report", report)
    assert r.exit_code == 0, r.output
    assert "the simulation is -50.0% off" in r.output
    html = report.read_text()
    assert 'id="measured"' in html and 'id="timeline"' in html and "-50.0% off" in html
    # A trace of another plan, or not a trace: one sentence, exit 1.
    other = _trace_of(simulate(plan, "gpipe", steps=3), plan)
    other["ranks"] = other["ranks"][:2]
    trace.write_text(json.dumps(other))
    r = run(path, "--compare", trace)
    assert r.exit_code == 1 and "the trace is of 2 GPUs, the plan has 3" in r.output
    r = run(path, "--compare", path)
    assert r.exit_code == 1 and "is not an ftpipe trace" in r.output and "Traceback" not in r.output


def test_compile_and_simulate_print_the_same_figures_in_binary_units(tmp_path):
    """One plan, one set of figures: compile simulates 20 steps, `ftpipe simulate` 10, and
    both print the same per-step bytes, step time and samples/s; sizes in MiB and GiB."""
    out = tmp_path / "out"
    r = CliRunner().invoke(cli, ["compile", "-m", "gpt2-tiny", "-g", "2", "--schedule", "2bw",
                                 "-p", "even-layers", "-o", str(out), "--json"])  # fmt: skip
    assert r.exit_code == 0, r.output
    compiled = json.loads(r.output[r.output.index("{") :])["simulated"]
    r = run(out / "plan.json", "--json")
    assert r.exit_code == 0, r.output
    simulated = json.loads(r.output)
    for key in ("step_time_s", "samples_per_s", "bubble_fraction"):
        assert simulated[key] == pytest.approx(compiled[key], rel=1e-12), key  # sums differ
    assert [g["bytes_sent"] for g in simulated["gpus"]] == [
        g["bytes_sent"] for g in compiled["gpus"]
    ]
    sent = sum(g["bytes_sent"] for g in compiled["gpus"])
    # The lines people read: simulate's, compile's report and the package's README.
    said = run(out / "plan.json").output
    report = (out / "report.html").read_text()
    readme = (out / "gpt2_tiny_pipeline" / "README.md").read_text()
    assert f"{sent / 2**20:10.2f} MiB per step (all GPUs)" in said
    assert f"<td>sent between GPUs</td><td>{size(sent)} per step</td>" in report  # its unit
    assert f"{compiled['gpus'][0]['bytes_sent'] / 2**20:.2f} |" in readme
    for text in (said, report, readme):
        assert not re.search(r"\bMB\b", text)
