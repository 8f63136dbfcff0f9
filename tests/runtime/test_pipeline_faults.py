"""Checkpoints resume exactly; a dead or hung rank stops every other rank with a message."""

from __future__ import annotations

import re
import signal
import time

import pytest
import torch
from ftpipe_runtime import run
from runtime_helpers import launch
from runtime_reference import checkpoint_params
from runtime_toy import PARAMS, STAGES, init_value, one_rank_plan, toy_plan

pytestmark = pytest.mark.multiproc
NAMED = r"(rank \d|ranks \[\d)"  # the peer waited for, or the group of a collective


def test_killed_run_resumes_exactly(run_pipeline, tmp_path):
    plan, steps = toy_plan("three-ranks", "gpipe"), 4
    base = ["--steps", str(steps), "--optimizer", "adamw", "--lr", "0.05", "--save-every", "2"]
    whole, broken = tmp_path / "whole", tmp_path / "broken"
    codes, ranks = run_pipeline(plan, [*base, "--checkpoint-dir", str(whole)], name="whole")
    assert codes == [0, 0, 0], ranks.stderr()

    # Rank 1 dies right after its step-2 checkpoint; the others notice and stop too.
    codes, ranks = run_pipeline(
        plan,
        [*base, "--checkpoint-dir", str(broken)],
        name="crash",
        env={"FTPIPE_FAULT": "1:1:exit"},
    )
    assert all(c != 0 for c in codes), ranks.stderr()
    assert not (broken / "step-000004").exists()
    codes, ranks = run_pipeline(
        plan, [*base, "--checkpoint-dir", str(broken), "--resume"], name="resume"
    )
    assert codes == [0, 0, 0], ranks.stderr()
    a, b = checkpoint_params(whole, steps, range(4)), checkpoint_params(broken, steps, range(4))
    for name in a:
        assert torch.equal(a[name], b[name]), name


def test_ranks_agree_to_skip_a_checkpoint_only_one_of_them_finds_damaged(run_pipeline, tmp_path):
    """Rank 1 holds stage 3; its file of step 2 is damaged. Both ranks must resume from step
    1 (rank 0 not from 2): the result is the uninterrupted run's (here on one rank, in this
    process; without clipping nothing is summed across ranks, so only the order of a few
    float additions may differ)."""
    base = ["--optimizer", "adamw", "--lr", "0.05", "--save-every", "1", "--clip", "0"]
    base += ["--decay", "constant"]
    whole, broken = tmp_path / "whole", tmp_path / "broken"
    run(one_rank_plan("1f1b"), STAGES, [*base, "--steps", "3", "--checkpoint-dir", str(whole)])
    plan, argv = toy_plan("two-ranks", "1f1b"), [*base, "--checkpoint-dir", str(broken)]
    codes, ranks = run_pipeline(plan, [*argv, "--steps", "2"], name="first")
    assert codes == [0, 0], ranks.stderr()
    (broken / "step-000002" / "stage-3.safetensors").write_bytes(b"\0" * 64)
    codes, ranks = run_pipeline(plan, [*argv, "--steps", "3", "--resume"], name="resume")
    assert codes == [0, 0], ranks.stderr()
    assert "step-000002 is damaged (stage-3.safetensors" in ranks.stderr(0)
    assert "resuming from step 1" in ranks.stderr(0)
    a, b = checkpoint_params(whole, 3, range(4)), checkpoint_params(broken, 3, range(4))
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=1e-6, atol=1e-7, msg=name)


def test_hung_rank_times_out_with_its_name(tmp_path):
    plan = toy_plan("three-ranks", "1f1b")
    argv = ["--steps", "4", "--timeout", "3"]
    ranks = launch(tmp_path, plan, argv, name="hang", env={"FTPIPE_FAULT": "1:1:hang"})
    try:
        codes = [ranks.procs[r].wait(timeout=60) for r in (0, 2)]
        assert all(c != 0 for c in codes), ranks.stderr()
        assert ranks.procs[1].poll() is None  # still hanging: nobody waited for it forever
        for r in (0, 2):
            assert re.search(rf"ftpipe rank {r}: .*{NAMED}", ranks.stderr(r)), ranks.stderr()
        assert "from rank 1" in ranks.stderr(0) + ranks.stderr(2), ranks.stderr()
    finally:
        ranks.kill()


def test_killed_rank_stops_the_others(tmp_path):
    plan = toy_plan("three-ranks", "ftpipe")
    argv = ["--steps", "2000", "--timeout", "30", "--log-every", "1"]
    ranks = launch(tmp_path, plan, argv, name="kill")
    try:
        deadline = time.monotonic() + 60
        while "step 3/" not in ranks.stderr(0):
            assert time.monotonic() < deadline and ranks.procs[0].poll() is None, ranks.stderr()
            time.sleep(0.2)
        ranks.procs[1].send_signal(signal.SIGKILL)
        killed = time.monotonic()
        codes = [ranks.procs[r].wait(timeout=60) for r in (0, 2)]
        assert time.monotonic() - killed < 60
        assert all(c != 0 for c in codes), ranks.stderr()
        for r in (0, 2):
            assert re.search(rf"ftpipe rank {r}: .*{NAMED}", ranks.stderr(r)), ranks.stderr()
        assert "rank 1" in ranks.stderr(0) + ranks.stderr(2)
    finally:
        ranks.kill()


def test_a_rank_that_cannot_start_stops_the_others_naming_it(run_pipeline, tmp_path):
    """Rank 1's stage 1 gets a wrong-shape --init weight: rank 1 says so, and rank 0 stops
    when they meet, naming rank 1 and why, long before --timeout."""
    weights = {name: init_value(name) for name in PARAMS}
    weights["l1.weight"] = torch.zeros(3, 3)
    torch.save(weights, tmp_path / "w.pt")
    plan, argv = toy_plan("two-ranks", "1f1b"), ["--steps", "2", "--timeout", "300"]
    begun = time.monotonic()
    codes, ranks = run_pipeline(plan, [*argv, "--init", str(tmp_path / "w.pt")], name="init")
    assert time.monotonic() - begun < 120
    assert codes == [1, 1], ranks.stderr()
    why = "l1.weight has shape (3, 3), stage 1 expects (8, 8)"
    assert f"ftpipe rank 1: --init {tmp_path / 'w.pt'}: {why}" in ranks.stderr(1)
    assert re.search(
        r"ftpipe rank 0: rank 1 could not start: --init .*" + re.escape(why), ranks.stderr(0)
    )
    assert "Traceback" not in ranks.stderr()


def test_setup_waits_for_a_stopped_peer_only_as_long_as_timeout(tmp_path):
    """Rank 1 is stopped before the ranks meet: rank 0 gives up after --timeout, not 300 s."""
    ranks = launch(tmp_path, toy_plan("two-ranks", "1f1b"), ["--steps", "2", "--timeout", "5"])
    try:
        ranks.procs[1].send_signal(signal.SIGSTOP)
        begun = time.monotonic()
        code = ranks.procs[0].wait(timeout=120)
        assert code == 1 and time.monotonic() - begun < 60, ranks.stderr(0)
        said = r"ftpipe rank 0: rank 0 waited 5 s \(--timeout\) for the other 1 rank\(s\)"
        assert re.search(said, ranks.stderr(0)), ranks.stderr(0)
        assert "Traceback" not in ranks.stderr(0)
    finally:
        ranks.procs[1].send_signal(signal.SIGCONT)
        ranks.kill()
