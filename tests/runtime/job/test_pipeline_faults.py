"""Checkpoints resume exactly; a dead or hung rank stops every other rank with a message."""

from __future__ import annotations

import json
import re
import signal
import time

import pytest
import torch
from ftpipe_runtime import run
from ftpipe_runtime.job.liveness import INTERRUPTED, TERMINATED
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
    """Rank 1 hangs alive: its heartbeat goes on, so --timeout never calls it gone; nobody
    progresses for --hang-timeout while it is busy, and the others stop naming it hung."""
    plan = toy_plan("three-ranks", "1f1b")
    argv = ["--steps", "4", "--timeout", "3", "--hang-timeout", "5"]
    ranks = launch(tmp_path, plan, argv, name="hang", env={"FTPIPE_FAULT": "1:1:hang"})
    try:
        codes = [ranks.procs[r].wait(timeout=60) for r in (0, 2)]
        assert all(c != 0 for c in codes), ranks.stderr()
        assert ranks.procs[1].poll() is None  # still hanging: nobody waited for it forever
        for r in (0, 2):
            assert re.search(rf"ftpipe rank {r}: .*{NAMED}", ranks.stderr(r)), ranks.stderr()
        both = ranks.stderr(0) + ranks.stderr(2)
        assert "from rank 1" in both, ranks.stderr()
        assert re.search(r"rank 1 has been busy for \d+ s without progress: hung", both), both
        assert "--hang-timeout is 5 s" in both and "Traceback" not in both
    finally:
        ranks.kill()


def test_frozen_rank_is_named_after_timeout(tmp_path):
    """Rank 1 stopped mid-run (SIGSTOP: no thread of it runs): its heartbeat stops, and
    rank 0 gives up after --timeout, naming it, though rank 1's process still exists."""
    argv = ["--steps", "2000", "--timeout", "3", "--log-every", "1"]
    ranks = launch(tmp_path, toy_plan("two-ranks", "1f1b"), argv, name="frozen")
    try:
        _wait_for_step(ranks, 2)
        ranks.procs[1].send_signal(signal.SIGSTOP)
        stopped = time.monotonic()
        assert ranks.procs[0].wait(timeout=60) == 1, ranks.stderr(0)
        assert time.monotonic() - stopped < 30
        said = r"ftpipe rank 0: gave up .*: rank 1 has sent no heartbeat for (\d+) s"  # (a receive, or the gradient norm's sum)
        silent = re.search(said, ranks.stderr(0))
        assert silent and int(silent[1]) >= 3, ranks.stderr(0)
        assert "--timeout is 3 s" in ranks.stderr(0) and "Traceback" not in ranks.stderr(0)
    finally:
        ranks.procs[1].send_signal(signal.SIGCONT)
        ranks.kill()


def test_a_receive_waits_as_long_as_its_sender_lives(run_pipeline, tmp_path):
    """Rank 1 is busy for 6 s after its first step (FTPIPE_FAULT slow) while rank 0 waits
    for its messages, posted long before (--timeout 3): a wait has no deadline of its own
    while the sender's heartbeat goes on. Same losses as the run without the stall."""
    argv = ["--steps", "3", "--timeout", "3", "--schedule", "1f1b"]
    plan, logs = toy_plan("two-ranks", "1f1b"), {}
    for name, env in [("plain", {}), ("slow", {"FTPIPE_FAULT": "1:1:slow:6"})]:
        logs[name] = tmp_path / f"{name}.json"
        began = time.monotonic()
        codes, ranks = run_pipeline(plan, [*argv, "--log-json", str(logs[name])], name, env)
        assert codes == [0, 0], ranks.stderr()
    assert time.monotonic() - began >= 6  # the stall happened
    plain, slow = (json.loads(logs[n].read_text()) for n in ("plain", "slow"))
    assert slow["losses"] == plain["losses"]


def test_peers_wait_for_rank_0_busy_at_the_end_longer_than_timeout(run_pipeline, tmp_path):
    """Rank 0 is busy for 6 s after its last step, as when it writes a checkpoint or
    --save-hf for minutes, while rank 1 waits for it in the run's last collectives
    (--timeout 3): it waits as long as rank 0's heartbeat goes on."""
    argv = ["--steps", "2", "--timeout", "3", "--save-every", "1"]
    argv += ["--checkpoint-dir", str(tmp_path / "ckpt")]
    began = time.monotonic()
    env = {"FTPIPE_FAULT": "0:1:slow:6"}
    codes, ranks = run_pipeline(toy_plan("two-ranks", "gpipe"), argv, "end", env)
    assert codes == [0, 0], ranks.stderr()
    assert time.monotonic() - began >= 6
    assert (tmp_path / "ckpt" / "step-000002").is_dir()


def test_ctrl_c_stops_every_rank_with_one_line_and_code_130(tmp_path):
    """Ctrl-C in the terminal (SIGINT to every rank) mid-run: each rank says so in one
    line and exits 130; no traceback, no gloo error."""
    argv = ["--steps", "2000", "--timeout", "300", "--log-every", "1"]
    ranks = launch(tmp_path, toy_plan("two-ranks", "1f1b"), argv, name="ctrl-c")
    try:
        _wait_for_step(ranks, 3)
        for p in ranks.procs:
            p.send_signal(signal.SIGINT)
        interrupted = time.monotonic()
        assert ranks.wait(60) == [130, 130], ranks.stderr()
        assert time.monotonic() - interrupted < 30
        for r in (0, 1):
            lines = ranks.stderr(r).splitlines()
            assert lines[-1] == f"ftpipe rank {r}: {INTERRUPTED[0]}", ranks.stderr()
            assert sum("interrupted" in line or "rror" in line for line in lines) == 1, lines
        assert "Traceback" not in ranks.stderr()
    finally:
        ranks.kill()


def test_an_interrupted_rank_stops_its_peers_at_once(tmp_path):
    """Ctrl-C on one rank only (its own terminal): it says so and exits 130, and tells the
    others, which stop at once naming it (not after --timeout: 300 s here), with 130 too."""
    argv = ["--steps", "2000", "--timeout", "300", "--log-every", "1"]
    ranks = launch(tmp_path, toy_plan("three-ranks", "1f1b"), argv, name="one")
    try:
        _wait_for_step(ranks, 3)
        ranks.procs[1].send_signal(signal.SIGINT)
        interrupted = time.monotonic()
        assert ranks.wait(60) == [130, 130, 130], ranks.stderr()
        assert time.monotonic() - interrupted < 30
        assert ranks.stderr(1).splitlines()[-1] == f"ftpipe rank 1: {INTERRUPTED[0]}"
        for r in (0, 2):
            last = ranks.stderr(r).splitlines()[-1]
            assert re.match(rf"ftpipe rank {r}: .*rank 1 stopped: interrupted \(Ctrl-C\)", last)
        assert "Traceback" not in ranks.stderr()
    finally:
        ranks.kill()


def test_ctrl_c_on_rank_0_stops_a_busy_peer_with_130(tmp_path):
    """Ctrl-C on rank 0 while rank 1 computes (FTPIPE_FAULT keeps it busy 6 s after step 2):
    rank 0 exits 130 and rank 1, whose next act is to post a receive or a send on the pair
    rank 0 closed, stops naming rank 0's Ctrl-C, 130 too. Gloo refuses that post at once,
    outside any wait: it was "unexpected error: RuntimeError: ... Connection closed by peer"
    and exit 1 (the audit's case, one run in two there)."""
    argv = ["--steps", "2000", "--timeout", "300", "--log-every", "1"]
    env = {"FTPIPE_FAULT": "1:2:slow:6"}
    ranks = launch(tmp_path, toy_plan("two-ranks", "1f1b"), argv, name="rank0", env=env)
    try:
        _wait_for_step(ranks, 2)  # rank 1 is busy now: its losses of step 2 came
        ranks.procs[0].send_signal(signal.SIGINT)
        assert ranks.wait(60) == [130, 130], ranks.stderr()
        assert ranks.stderr(0).splitlines()[-1] == f"ftpipe rank 0: {INTERRUPTED[0]}"
        last = ranks.stderr(1).splitlines()[-1]
        assert re.fullmatch(rf"ftpipe rank 1: gave up .*: rank 0 stopped: {re.escape(INTERRUPTED[0])}", last), ranks.stderr()  # fmt: skip
        assert "Traceback" not in ranks.stderr()
    finally:
        ranks.kill()


def test_sigterm_on_one_rank_is_one_line_and_code_143_on_every_rank(tmp_path):
    """SIGTERM (what torchrun sends the other workers when one fails) on rank 1: it says so
    and exits 143, and its peer stops at once naming it, with 143 too (it died silently)."""
    argv = ["--steps", "2000", "--timeout", "300", "--log-every", "1"]
    ranks = launch(tmp_path, toy_plan("two-ranks", "1f1b"), argv, name="term")
    try:
        _wait_for_step(ranks, 3)
        ranks.procs[1].send_signal(signal.SIGTERM)
        assert ranks.wait(60) == [143, 143], ranks.stderr()
        assert ranks.stderr(1).splitlines()[-1] == f"ftpipe rank 1: {TERMINATED[0]}"
        last = ranks.stderr(0).splitlines()[-1]
        assert re.match(r"ftpipe rank 0: .*rank 1 stopped: stopped \(SIGTERM\)", last), last
        assert "Traceback" not in ranks.stderr()
    finally:
        ranks.kill()


def test_an_unexpected_error_is_one_sentence_and_stops_the_peers(run_pipeline, tmp_path):
    """An exception nobody foresaw on rank 1 (FTPIPE_FAULT raise): one sentence, exit 1,
    and its peers stop at once naming it (--timeout 300 is never reached); --debug adds
    the traceback."""
    plan, argv = toy_plan("two-ranks", "1f1b"), ["--steps", "4", "--timeout", "300"]
    began = time.monotonic()
    codes, ranks = run_pipeline(plan, argv, "raise", {"FTPIPE_FAULT": "1:1:raise"})
    assert codes == [1, 1] and time.monotonic() - began < 100, ranks.stderr()
    said = "unexpected error: RuntimeError: FTPIPE_FAULT raises (--debug shows where)"
    assert ranks.stderr(1).splitlines()[-1] == f"ftpipe rank 1: {said}", ranks.stderr()
    assert re.search(r"ftpipe rank 0: .*rank 1 stopped: unexpected error", ranks.stderr(0))
    assert "Traceback" not in ranks.stderr()
    codes, ranks = run_pipeline(plan, [*argv, "--debug"], "debug", {"FTPIPE_FAULT": "1:1:raise"})
    assert codes == [1, 1], ranks.stderr()
    assert "Traceback" in ranks.stderr(1) and 'raise RuntimeError("FTPIPE_FAULT' in ranks.stderr(1)


def _wait_for_step(ranks, step: int) -> None:
    """Until rank 0 logged `step` (the ranks are then well into the run)."""
    deadline = time.monotonic() + 120
    while f"step {step}/" not in ranks.stderr(0):
        assert time.monotonic() < deadline and ranks.procs[0].poll() is None, ranks.stderr()
        time.sleep(0.2)


def test_killed_rank_stops_the_others(tmp_path):
    plan = toy_plan("three-ranks", "ftpipe")
    argv = ["--steps", "2000", "--timeout", "30", "--log-every", "1"]
    ranks = launch(tmp_path, plan, argv, name="kill")
    try:
        _wait_for_step(ranks, 3)
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
    """Rank 1 is stopped before it ever beats: rank 0 gives up after --timeout, not 300 s.
    (Cold ranks: a forked one might beat before the SIGSTOP reaches it.)"""
    argv, plan = ["--steps", "2", "--timeout", "5"], toy_plan("two-ranks", "1f1b")
    ranks = launch(tmp_path, plan, argv, fork=False)
    try:
        ranks.procs[1].send_signal(signal.SIGSTOP)
        begun = time.monotonic()
        code = ranks.procs[0].wait(timeout=120)
        assert code == 1 and time.monotonic() - begun < 60, ranks.stderr(0)
        said = r"ftpipe rank 0: gave up waiting for the other 1 rank\(s\) to meet: rank 1 has not "
        said += r"started: no heartbeat from it in \d+ s \(--timeout is 5 s\)"
        assert re.search(said, ranks.stderr(0)), ranks.stderr(0)
        assert "Traceback" not in ranks.stderr(0)
    finally:
        ranks.procs[1].send_signal(signal.SIGCONT)
        ranks.kill()
