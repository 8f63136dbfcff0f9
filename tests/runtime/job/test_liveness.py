"""Liveness: which peer is gone, and why, from the heartbeats in the store (in one process,
on a clock the test moves: the peers' heartbeats are written by the test); the
multi-process cases are in test_pipeline_faults.py."""

from __future__ import annotations

import json

import pytest
import torch.distributed as dist
from ftpipe_runtime.engine import comm
from ftpipe_runtime.errors import PeerFailure
from ftpipe_runtime.job import liveness


class _Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


@pytest.fixture
def watched(tmp_path, monkeypatch):
    """(rank 0's Liveness of a 3-rank job on a file store, with its watchdog stopped: the
    test reads the store and judges; a writer of a peer's heartbeat; the clock)."""
    clock = _Clock()
    monkeypatch.setattr(liveness, "_now", clock)
    store = dist.FileStore(str(tmp_path / "store"), 1)
    live = liveness.Liveness(store, rank=0, world=3, timeout_s=60, hang_s=600)
    live.close()  # the watchdog stops; what it would judge is judged here
    peers = dist.PrefixStore("ftpipe-liveness", store)

    def beat(rank: int, **value):
        peers.set(str(rank), json.dumps({"beat": 1, "progress": 0, "state": "busy", **value}))
        live._read()

    return live, beat, clock


def test_a_peer_never_heard_from_has_not_started_after_timeout(watched):
    live, beat, clock = watched
    beat(1)
    assert live.gone() is None
    clock.t += 61
    beat(1, beat=2)  # rank 1 beats on; rank 2 never did
    why, code = live.gone()
    assert why.startswith("rank 2 has not started: no heartbeat from it in 61 s")
    assert "--timeout is 60 s" in why and code == 1


def test_a_silent_peer_is_gone_after_timeout_however_long_a_wait(watched):
    live, beat, clock = watched
    beat(1)
    beat(2)
    for n in range(2, 8):  # 50 s of beats from both: a wait can last that long
        clock.t += 10
        beat(1, beat=n)
        beat(2, beat=n)
    assert live.gone() is None
    for n in range(8, 15):  # rank 2 stops beating
        clock.t += 10
        beat(1, beat=n)
    why, code = live.gone()
    assert why.startswith("rank 2 has sent no heartbeat for 70 s: it was killed") and code == 1


def test_a_watchdog_kept_from_looking_does_not_count_that_as_silence(watched):
    live, beat, clock = watched
    beat(1)
    beat(2)
    clock.t += 300  # this rank's watchdog could not run (its GIL held): nothing was read
    assert live.gone() is None


def test_a_peer_that_said_it_stopped_is_named_with_its_sentence_and_code(watched):
    live, beat, _ = watched
    beat(1)
    beat(2, state="stopped", why="interrupted (Ctrl-C)", code=130)
    assert live.gone() == ("rank 2 stopped: interrupted (Ctrl-C)", 130)
    beat(2, state="stopped", why="FTPIPE_FAULT stops this rank", code=3)
    assert live.gone() == ("rank 2 stopped: FTPIPE_FAULT stops this rank", 1)
    with pytest.raises(PeerFailure, match="gave up waiting for X: rank 2 stopped") as failed:
        with live.waiting("waiting for X"):
            pytest.fail("a wait with a peer gone must not begin")
    assert failed.value.code == 1


def test_a_busy_peer_is_hung_only_when_nobody_progressed_for_hang_timeout(watched):
    live, beat, clock = watched
    for n in range(1, 62):  # 610 s of beats, and no progress anywhere
        beat(1, beat=n, state="waiting")
        beat(2, beat=n, state="busy")
        clock.t += 10
    beat(1, beat=62, state="waiting")
    beat(2, beat=62, state="busy")
    why, code = live.gone()
    assert why.startswith("rank 2 has been busy for 610 s without progress: hung") and code == 1
    assert "--hang-timeout is 600 s" in why
    beat(2, beat=63, state="waiting")  # everyone waits: a deadlock, nobody to blame
    assert live.gone()[0].startswith("no rank has progressed for 610 s: each waits for another")
    beat(1, beat=63, state="waiting", progress=1)  # rank 1 progressed: the run moves
    assert live.gone() is None


def test_a_long_busy_stretch_below_hang_timeout_is_waited_for(watched):
    live, beat, clock = watched
    for n in range(1, 59):  # rank 2 busy for 580 s (a save, a slow step), beating
        beat(1, beat=n, state="waiting")
        beat(2, beat=n, state="busy")
        clock.t += 10
    assert live.gone() is None


def test_a_finished_peer_is_not_watched(watched):
    live, beat, clock = watched
    beat(1, state="done")
    beat(2)
    for n in range(2, 200):
        clock.t += 10
        beat(2, beat=n, progress=n)
    assert live.gone() is None


def test_the_ranks_that_write_no_more_are_the_stopped_the_done_and_the_silent(watched):
    live, beat, clock = watched
    beat(1, state="stopped", why="cannot write x: No space left on device")
    beat(2)
    assert live.lost() == {1}
    beat(1, state="done")
    clock.t += 61
    live._read()  # rank 2 silent past --timeout
    assert live.lost() == {1, 2}


def test_a_failed_exit_tidies_with_the_ranks_that_write_no_more(monkeypatch):
    monkeypatch.setattr(liveness, "_tidying", {})
    seen = []
    liveness.on_failure("fails", lambda stopped: 1 / 0)  # swallowed: the rank goes anyway
    liveness.on_failure("files", seen.append)
    liveness.on_failure("files", lambda stopped: seen.append(sorted(stopped)))  # replaces
    liveness.tidy({0, 2})
    assert seen == [[0, 2]]
    liveness.tidy({1})  # once: the run they tidied for is over
    assert seen == [[0, 2]]
    liveness.on_failure("files", seen.append)
    liveness.on_failure("files", None)  # its run ended well
    liveness.tidy({1})
    assert seen == [[0, 2]]


class _NcclWork:
    """An NCCL work as the CPU sees it: complete after a few polls; `wait` only orders the
    streams."""

    def __init__(self, polls: int):
        self.polls, self.waited = polls, False

    def is_completed(self) -> bool:
        self.polls -= 1
        return self.polls <= 0

    def wait(self):
        assert self.polls <= 0, "waited before the message arrived"
        self.waited = True


def test_an_nccl_wait_polls_until_the_message_is_there():
    work = _NcclWork(polls=5)
    _, wait = comm._BACKENDS["cuda"]
    wait(work)
    assert work.waited and work.polls == 0
