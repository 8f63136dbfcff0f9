"""The driver that runs `compile`'s phases: order, timings, one output, no bar off a terminal."""

from __future__ import annotations

import json
import re

import click
import pytest
from click.testing import CliRunner

from ftpipe_compiler.cli.compile_phases import Job, pipeline_for
from ftpipe_compiler.cli.driver import Phase, Pipeline, drive


def _run(as_json: bool, fail_at: str | None = None):
    done = []

    def phase(name):
        def run(job, progress):
            if name == fail_at:
                raise RuntimeError(name)
            done.append(name)
            job[name] = len(done)

        return Phase(name, f"{name}_s", run)

    pipeline = Pipeline(
        phases=(phase("a"), phase("b"), phase("c")),
        to_json=lambda job, timings: {"job": job, "timings": sorted(timings)},
        lines=lambda job, timings: [f"{k}={v}" for k, v in job.items()],
    )

    @click.command()
    def command():
        drive(pipeline, {}, as_json=as_json)

    result = CliRunner().invoke(command)
    return done, result


def test_phases_run_in_order_and_the_output_is_printed_once_with_every_timing():
    done, result = _run(as_json=True)
    assert done == ["a", "b", "c"]
    assert json.loads(result.output) == {
        "job": {"a": 1, "b": 2, "c": 3},
        "timings": ["a_s", "b_s", "c_s", "total_s"],
    }
    assert result.stderr == ""  # --json: the JSON alone
    done, result = _run(as_json=False)
    assert result.stdout == "a=1\nb=2\nc=3\n"
    # No terminal (CliRunner's stderr is none): no bar, a line per phase with its time.
    assert re.fullmatch(r"(compile: [abc] \(\d+\.\d s\)\n){3}", result.stderr), result.stderr
    assert [line.split()[1] for line in result.stderr.splitlines()] == ["a", "b", "c"]


def test_a_failing_phase_stops_the_pipeline_before_any_output():
    done, result = _run(as_json=False, fail_at="b")
    assert done == ["a"] and result.stdout == "" and result.stderr == "compile: a (0.0 s)\n"
    assert isinstance(result.exception, RuntimeError)


@pytest.mark.parametrize("cluster", [None, "a cluster"])
@pytest.mark.parametrize("alpha", [None, 0.5])
def test_compile_runs_the_freeze_training_phase_only_when_asked(cluster, alpha, tmp_path):
    job = Job(out=tmp_path, force=False, command="", cost_args={}, gpus=2, schedules=["1f1b"],
              search_width=1, jobs=None, partitioners=None, optimizer=None, micro_batches=None,
              replicas=None, steps=2, seed=0, freeze_alpha=alpha, cluster=cluster)  # fmt: skip
    timings = [p.timing for p in pipeline_for(job).phases]
    search = "plan_s" if cluster else "search_s"
    shrink = ["freeze_training_s"] if alpha else []
    assert timings == ["trace_profile_s", search, *shrink, "generate_s"]
