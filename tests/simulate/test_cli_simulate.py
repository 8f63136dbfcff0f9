"""`ftpipe simulate`: the table, --json, --report, and one sentence for a bad plan file."""

from __future__ import annotations

import json

from click.testing import CliRunner

from ftpipe_compiler.cli import cli


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
    assert data["step_time_s"] == 4.0 * (2 + 3 - 1)  # GPipe, 3 equal stages, 2 micro-batches
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
