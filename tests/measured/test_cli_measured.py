"""`ftpipe profile --profile measured` through click's CliRunner."""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner

from ftpipe_compiler.cli import cli


def run(*args):
    return CliRunner().invoke(cli, list(args))


def test_profile_measured_on_t5_tiny(tmp_path, timed_blocks):
    out = tmp_path / "g.json"
    args = ["profile", "-m", "t5-tiny", "--profile", "measured", "--repeats", "1"]
    r = run(*args, "--granularity", "layer", "--json", "-o", str(out))
    assert r.exit_code == 0, r.output
    summary = json.loads(r.output)
    assert (summary["profile"], summary["hardware"]) == ("measured", "cpu")
    assert summary["forward_s"] > 0 and summary["backward_s"] > 0
    graph = json.loads(out.read_text())
    assert len(timed_blocks) == summary["nodes"] == len(graph["nodes"])
    # The second run reads the cache; --no-cache times every block again.
    assert run(*args, "--granularity", "layer").exit_code == 0
    assert len(timed_blocks) == summary["nodes"]
    assert run(*args, "--granularity", "layer", "--no-cache").exit_code == 0
    assert len(timed_blocks) == 2 * summary["nodes"]


def test_a_block_over_the_limit_exits_1_with_one_sentence():
    r = run("profile", "-m", "t5-tiny", "--profile", "measured", "--granularity", "layer",
            "--memory-limit", "0.0001")  # fmt: skip
    assert r.exit_code == 1
    lines = r.output.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in r.output
    assert lines[0].startswith("Error: block encoder.block.0 needs 0.00 GB on its own")
    assert lines[0].endswith("more than --memory-limit 0.0001 GB; use --granularity op")


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_cuda_without_a_gpu():
    r = run("profile", "-m", "t5-tiny", "--profile", "measured", "--device", "cuda")
    assert r.exit_code == 1
    assert r.output.strip() == "Error: CUDA is not available on this machine; use --device cpu"
