"""T5-3B (2,607 traced ops, on `meta`): generating 8 or 16 stages is quick, and the package
imports and builds its stages without a GPU and without memory."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
from codegen_helpers import REPO, contiguous, costed, ruff_check

from ftpipe_compiler.codegen import generate_package

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("stages", [8, 16])
def test_t5_3b_package(stages, tmp_path):
    spec, _, traced, graph = costed("t5-3b")
    assert len(graph.nodes) > 2500
    plan = contiguous(graph, stages, gpus=8)
    start = time.perf_counter()
    pkg = generate_package(traced, graph, plan, spec, tmp_path, command="pytest")
    seconds = time.perf_counter() - start
    print(f"t5-3b, {stages} stages: generated in {seconds:.2f} s")
    assert seconds < 30
    code = (pkg / "stages.py").read_text()
    for block in (0, 23):
        assert f"# encoder.block.{block} (T5Block)" in code
        assert f"# decoder.block.{block} (T5Block)" in code
    probe = (
        f"import {pkg.name} as p, torch; assert not torch.cuda.is_available(); "
        "n = sum(t.numel() for c in p.STAGES.values() for t in c(materialize=False).parameters()); "
        "print(n)"
    )
    env = {
        **os.environ,
        "CUDA_VISIBLE_DEVICES": "",
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
    }
    run = subprocess.run(
        [sys.executable, "-c", probe],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr
    # Every parameter exactly once, the tied embedding too (its other readers receive it).
    assert int(run.stdout.split()[-1]) == sum(_numel(p.shape) for p in plan.params)
    result = ruff_check(pkg)
    if result is not None:
        assert result.returncode == 0, result.stdout


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n
