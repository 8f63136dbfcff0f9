"""Whether the other ranks still run: a heartbeat in the rendezvous store decides that a peer
is gone, not how long one wait lasted; and the one way a rank stops (`die`).

    live = start(rank, world, "file:///tmp/x/store", timeout_s=60, hang_s=1800)
    ...                                        # this rank's own set-up (weights: minutes)
    live.meet()                                # every rank set up, or a gone one named
    with waiting(f"waiting for gradient 'x' from rank 1"):
        work.wait()                            # no deadline of its own
    die("rank 1 could not start", 1)           # peers told, one line, the exit code

Each rank's watchdog thread writes a heartbeat into the rendezvous store every second (a
quarter of `--timeout` when that is shorter) and reads every peer's. A peer is gone when
- it said so: a rank that stops for any reason (an error, Ctrl-C, a peer of its own lost)
  writes its sentence into its heartbeat before it exits (`die`), and its peers stop at once
  naming it and why;
- its heartbeat has not changed for `--timeout` seconds: killed, stopped (SIGSTOP), its
  machine lost, or a process so stuck its threads cannot run; a rank never heard from
  counts from this one's start;
- no rank has progressed (begun or ended a wait) for `--hang-timeout` seconds while it
  is busy: a live rank stuck in one computation or write (a hung kernel, a stuck disk),
  named as hung. When every rank waits for another, none is named: a deadlock.
A long but healthy step, rank 0 writing a checkpoint or `--save-hf` for minutes, a rank
loading its weights before the ranks meet, one micro-batch 65x slower in bf16 on a CPU
without bf16 instructions: the heartbeat goes on, so nobody gives up on that rank, however
long one receive waits (NCCL's clock would have started when the receive was posted, often
steps ahead). The process groups get `backstop`, far beyond.

While the main thread waits (`waiting`), the watchdog ends the process as soon as a peer is
gone, with one sentence naming the peer and what this rank waited for; a busy main thread
is never ended by it (its save may be worth finishing) and learns of a lost peer at its
next wait. A gloo wait blocks in C++ where Python cannot interrupt it, so Ctrl-C (and
SIGTERM: `signals.catch_sigterm`, exit code 143) reaches the watchdog through the signal
wake-up pipe: a waiting rank stops at once, a busy one gets `GRACE_S` to stop by itself
(its KeyboardInterrupt, or `Terminated`) first.

Every time is this rank's own monotonic clock (when it saw a heartbeat change), so the
machines' clocks need not agree, and a watchdog kept from running (the main thread holding
the GIL) does not count the time it did not look as silence.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import sys
import threading
import time
from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist

from ..errors import PeerFailure
from .signals import Terminated, stopped

__all__ = [
    "INTERRUPTED",
    "TERMINATED",
    "Liveness",
    "backstop",
    "current",
    "die",
    "failure",
    "on_failure",
    "short",
    "start",
    "tidy",
    "waiting",
]

KEPT = "complete checkpoints already written are kept"
INTERRUPTED = stopped(KeyboardInterrupt(), KEPT)  # (the sentence, 130)
TERMINATED = stopped(Terminated(), KEPT)  # (the sentence, 143): torchrun stopping a worker
BEAT_S = 1.0  # between heartbeats (a quarter of --timeout when that is shorter)
GRACE_S = 2.0  # Ctrl-C: how long a busy main thread gets to stop by itself
CLOSED = ("Connection closed by peer", "Connection reset by peer")
ANNOUNCE_S = 2.0  # at most this long telling the peers, even with the store gone
POLL_S = 0.05  # the meeting: how often to look for the others

_current: Liveness | None = None
_now = time.monotonic  # every time here is this rank's own (a test sets the clock)
_ending = threading.Lock()  # one thread ends the process
_tidying: dict = {}  # name -> fn(ranks that write no more): run on a failed exit (`tidy`)
TIDY_S = 10.0  # at most this long tidying on the way out (a stuck disk must not hold it)


def backstop(hang_s: float) -> timedelta:
    """The process groups' own timeout: a day, or twice --hang-timeout when that is longer,
    so that liveness always decides first."""
    return max(timedelta(days=1), timedelta(seconds=2 * hang_s))


def current() -> Liveness | None:
    return _current


def start(rank: int, world: int, init_method: str, *, timeout_s: float, hang_s: float):
    """Meet the rendezvous store and start beating (once per process; None on one rank)."""
    global _current
    if world == 1 or _current is not None:
        return _current
    try:
        rendezvous = dist.rendezvous(init_method, rank, world, timeout=timedelta(seconds=timeout_s))
        store, _, _ = next(rendezvous)
    except Exception as e:  # noqa: BLE001 - any rendezvous failure: the store is not there
        raise PeerFailure(
            f"rank {rank} could not reach the rendezvous {init_method} in {timeout_s:g} s "
            f"(--timeout): {short(e)}"
        ) from e
    store.set_timeout(backstop(hang_s))
    _current = Liveness(store, rank=rank, world=world, timeout_s=timeout_s, hang_s=hang_s)
    return _current


def waiting(what: str):
    """`with waiting("waiting for X from rank 1"):` around a wait of the main thread (a
    no-op without peers)."""
    return _current.waiting(what) if _current is not None else contextlib.nullcontext()


def failure(prefix: str, error: Exception) -> PeerFailure:
    """The PeerFailure of a wait that raised (gloo: the peer's connection closed): the
    peer's own sentence when it said why it stopped, else the backend's error."""
    said = _current.said() if _current is not None else None
    if said is not None:
        return PeerFailure(f"{prefix}: {said[0]}", code=said[1])
    text = short(error)
    if any(closed in text for closed in CLOSED):  # gloo's words for a peer gone without one
        text = "its connection closed: it was killed, or its machine lost"
    return PeerFailure(f"{prefix}: {text}")


def die(why: str, code: int):
    """End this process: tell the peers why (when it has any), say it in one line, exit
    with `code` (`os._exit`: a process group with a dead member cannot be shut down
    cleanly, and nothing else should run)."""
    if not _ending.acquire(blocking=False):  # another thread is ending it already
        while True:
            with contextlib.suppress(BaseException):
                time.sleep(60)
    live = _current
    if live is not None:
        live.announce(why, code)
    rank = live.rank if live is not None else int(os.environ.get("RANK", 0))
    print(f"ftpipe rank {rank}: {why}", file=sys.stderr, flush=True)
    sys.stdout.flush()
    tidy({rank} | (live.lost() if live is not None else set()))
    os._exit(code)


def on_failure(name: str, tidy_up) -> None:
    """`tidy_up(stopped)` runs when this rank stops with an error (`die`, `tidy`), with the
    ranks known to write no more (this one among them): a checkpoint's part that can never
    be complete goes (`Checkpoints.leave`). One per name: a later one replaces it, None
    removes it (a run that ended well: a later one in the process must not tidy for it)."""
    if tidy_up is None:
        _tidying.pop(name, None)
    else:
        _tidying[name] = tidy_up


def tidy(stopped: set[int]) -> None:
    """Run the `on_failure` hooks (each error swallowed: the rank is on its way out anyway),
    for at most TIDY_S."""
    hooks = list(_tidying.values())
    _tidying.clear()  # once: the run they tidy for is over

    def each():
        for tidy_up in hooks:
            with contextlib.suppress(Exception):
                tidy_up(stopped)

    tidier = threading.Thread(target=each, name="ftpipe-tidy", daemon=True)
    tidier.start()
    tidier.join(TIDY_S)


def short(e: Exception) -> str:
    """The first line of an exception, at most 200 characters."""
    text = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    return text if len(text) < 200 else text[:200] + "..."


@dataclass
class _Peer:
    """What this rank knows of another one, in its own clock."""

    seen: float  # when its heartbeat last changed (this rank's start: never heard from)
    moved: float  # when its progress last changed
    beat: int = -1
    progress: int = -1
    state: str = "unseen"  # then busy, waiting, stopped or done
    why: str = ""  # a stopped rank's sentence
    code: int = 1


class Liveness:
    """This rank's heartbeat and its watch over the others' (see the module)."""

    def __init__(self, store, *, rank: int, world: int, timeout_s: float, hang_s: float):
        self.rank, self.world = rank, world
        self.timeout_s, self.hang_s = timeout_s, hang_s
        # A client of its own where the store has clients: the process groups' store waits
        # never hold up a heartbeat.
        self.store = dist.PrefixStore("ftpipe-liveness", store.clone())
        self.pg_store = dist.PrefixStore("default_pg", store)  # as init_process_group names it
        self.beat_s = min(BEAT_S, timeout_s / 4)
        now = _now()
        self.peers = {r: _Peer(now, now) for r in range(world) if r != rank}
        self.read_at = now  # when the store last answered
        self.failing: tuple[float, str] | None = None  # since when the store fails, and how
        self.what: str | None = None  # what the main thread waits for; None: it works
        self.progress, self.moved = 0, now
        self.beats = 0
        self.interrupted: tuple[float, tuple[str, int]] | None = None  # when Ctrl-C came, why
        self._lock = threading.Lock()  # one write at a time: no beat after the last word
        self._said = False
        self._closing = threading.Event()
        self._wakeup = self._catch_interrupts()
        self._beat()
        self._thread = threading.Thread(target=self._watch, name="ftpipe-liveness", daemon=True)
        self._thread.start()

    # --- the main thread ---
    @contextlib.contextmanager
    def waiting(self, what: str):
        """The main thread waits for `what` inside: the watchdog may end the process if a
        peer is gone meanwhile; one gone already is a PeerFailure now."""
        outer = self.what
        self._move()
        verdict = self.gone()
        if verdict is not None:
            raise PeerFailure(f"gave up {what}: {verdict[0]}", code=verdict[1])
        self.what = what
        try:
            yield
        finally:
            self.what = outer
            self._move()

    def meet(self) -> None:
        """Wait until every rank has set itself up (while their heartbeats go on)."""
        self.store.set(f"met/{self.rank}", "1")
        keys = [f"met/{r}" for r in self.peers]
        with self.waiting(f"waiting for the other {len(keys)} rank(s) to meet"):
            while not self.store.check(keys):
                time.sleep(POLL_S)

    def said(self) -> tuple[str, int] | None:
        """A stopped peer's sentence and exit code, read from the store now."""
        self._read()
        return self._stopped()

    def gone(self) -> tuple[str, int] | None:
        """(why a peer counts as gone, the exit code that follows), or None."""
        return self._stopped() or self._silent() or self._stuck()

    def lost(self) -> set[int]:
        """The peers that write no more: stopped, done, or silent past --timeout."""
        return {
            r
            for r, p in self.peers.items()
            if p.state in ("stopped", "done") or self.read_at - p.seen > self.timeout_s
        }

    def _stopped(self) -> tuple[str, int] | None:
        for r, p in self.peers.items():
            if p.state == "stopped":
                return f"rank {r} stopped: {p.why}", _code(p)
        return None

    def _silent(self) -> tuple[str, int] | None:
        """The store, or a peer, silent for longer than --timeout."""
        limit = f"--timeout is {self.timeout_s:g} s"
        if self.failing and _now() - self.failing[0] > self.timeout_s:
            silent = _now() - self.failing[0]
            return (
                f"the rendezvous store has not answered for {silent:.0f} s ({limit}): {self.failing[1]}",
                1,
            )
        for r, p in self.peers.items():
            silent = self.read_at - p.seen
            if p.state == "done" or silent <= self.timeout_s:
                continue
            if p.state == "unseen":
                why = f"no heartbeat from it in {silent:.0f} s ({limit}); is it stopped, or not started?"
                return f"rank {r} has not started: {why}", 1
            why = (
                f"it was killed, stopped or lost ({limit}; raise it if a rank can freeze that long)"
            )
            return f"rank {r} has sent no heartbeat for {silent:.0f} s: {why}", 1
        return None

    def _stuck(self) -> tuple[str, int] | None:
        """No rank progressed for longer than --hang-timeout: the busy one is hung."""
        moved = [self.moved, *(p.moved for p in self.peers.values() if p.state != "done")]
        idle = self.read_at - max(moved)
        if idle <= self.hang_s:
            return None
        limit = f"--hang-timeout is {self.hang_s:g} s"
        busy = [r for r, p in self.peers.items() if p.state == "busy"]
        if busy:
            why = f"hung ({limit}; raise it if a step or a save takes that long)"
            return f"rank {busy[0]} has been busy for {idle:.0f} s without progress: {why}", 1
        return f"no rank has progressed for {idle:.0f} s: each waits for another ({limit})", 1

    def announce(self, why: str, code: int) -> None:
        """Tell the peers that this rank stops and why (at most ANNOUNCE_S: the store may be
        gone too)."""

        def tell():
            with self._lock:
                self._said = True
                said = {"state": "stopped", "why": why, "code": code}
                self.store.set(str(self.rank), json.dumps({"beat": self.beats + 1, **said}))

        teller = threading.Thread(target=tell, name="ftpipe-last-word", daemon=True)
        teller.start()
        teller.join(ANNOUNCE_S)

    def close(self) -> None:
        """This rank is done: the peers stop watching it; Ctrl-C is Python's again."""
        global _current
        self._closing.set()
        self._thread.join()
        with self._lock, contextlib.suppress(Exception):
            self._said = True
            self.store.set(str(self.rank), json.dumps({"beat": self.beats + 1, "state": "done"}))
        if self._wakeup is not None:
            read_end, write_end, old = self._wakeup
            signal.set_wakeup_fd(old)
            os.close(read_end)
            os.close(write_end)
        if _current is self:
            _current = None

    def _move(self) -> None:
        self.progress += 1
        self.moved = _now()

    # --- the watchdog thread ---
    def _watch(self) -> None:
        while not self._closing.is_set():
            try:
                self._sleep()
                if self._closing.is_set():
                    return
                self._beat()
                self._read()
                verdict = self._verdict()
            except Exception as e:  # noqa: BLE001 - a silent watchdog would look like a dead rank
                verdict = f"unexpected error watching the other ranks: {short(e)}", 1
            if verdict is not None:
                die(*verdict)

    def _verdict(self) -> tuple[str, int] | None:
        what = self.what
        if self.interrupted is not None and (
            what is not None or _now() - self.interrupted[0] > GRACE_S
        ):
            return self.interrupted[1]
        if what is None:
            return None
        gone = self.gone()
        return None if gone is None else (f"gave up {what}: {gone[0]}", gone[1])

    def _sleep(self) -> None:
        """A beat's time, or less: Ctrl-C wakes the watchdog."""
        if self._wakeup is None:
            self._closing.wait(self.beat_s)
            return
        read_end = self._wakeup[0]
        ready, _, _ = select.select([read_end], [], [], self.beat_s)
        if ready and self.interrupted is None:
            came = os.read(read_end, 512)
            for signum, verdict in ((signal.SIGTERM, TERMINATED), (signal.SIGINT, INTERRUPTED)):
                if signum in came:
                    self.interrupted = (_now(), verdict)
                    break

    def _beat(self) -> None:
        with self._lock:
            if self._said:
                return
            self.beats += 1
            state = "waiting" if self.what is not None else "busy"
            value = {"beat": self.beats, "progress": self.progress, "state": state}
            try:
                self.store.set(str(self.rank), json.dumps(value))
            except Exception as e:  # noqa: BLE001 - a store that fails counts as silence
                self.failing = self.failing or (_now(), short(e))

    def _read(self) -> None:
        """Every peer's heartbeat from the store; the time each last changed."""
        try:
            for r, p in self.peers.items():  # one never seen: is it there yet?
                if p.state == "unseen" and self.store.check([str(r)]):
                    p.state = "busy"
            there = [r for r, p in self.peers.items() if p.state != "unseen"]
            values = self.store.multi_get([str(r) for r in there]) if there else []
        except Exception as e:  # noqa: BLE001
            self.failing = self.failing or (_now(), short(e))
            return
        now = _now()
        self.read_at, self.failing = now, None
        for r, raw in zip(there, values):
            v, p = json.loads(raw), self.peers[r]
            if v["beat"] != p.beat:
                p.beat, p.seen = v["beat"], now
            if v.get("progress", p.progress) != p.progress:
                p.progress, p.moved = v["progress"], now
            p.state, p.why, p.code = v["state"], v.get("why", ""), v.get("code", 1)

    def _catch_interrupts(self):
        """(read end, write end, the old fd) of the pipe Python writes each signal's number
        to, or None where signals cannot be caught so (not the main thread)."""
        read_end, write_end = os.pipe()
        os.set_blocking(write_end, False)
        try:
            old = signal.set_wakeup_fd(write_end, warn_on_full_buffer=False)
        except ValueError:  # only the main thread may
            os.close(read_end)
            os.close(write_end)
            return None
        return read_end, write_end, old


def _code(peer: _Peer) -> int:
    """A peer interrupted by Ctrl-C (or SIGTERM) interrupts the run: 130 (143) here too;
    else 1."""
    return peer.code if peer.code in (INTERRUPTED[1], TERMINATED[1]) else 1
