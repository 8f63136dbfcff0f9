"""The partition and the schedule chosen together: the search against an exhaustive one."""

from __future__ import annotations

import math
import multiprocessing
import os
import signal
import time
from collections import namedtuple
from dataclasses import replace
from itertools import product

import pytest
from ftpipe_runtime.job.signals import Terminated, catch_sigterm

from ftpipe_compiler.errors import FtpipeError
from ftpipe_compiler.partition import PARTITIONERS, problem_from_graph
from ftpipe_compiler.planner.matrix import (
    CHEAP,
    Cell,
    evaluate,
    schedule_names,
    search_matrix,
    update_rule,
)

SCHEDULES = schedule_names("auto")


@pytest.fixture(scope="module")
def problem(tiny_t5_costed):
    return problem_from_graph(tiny_t5_costed, 3, "rtx2080ti", "1f1b", "adamw", 6)


def test_schedule_groups():
    assert schedule_names("sync") == ["gpipe", "1f1b", "zb1p", "zb2p", "zbv", "interleaved"]
    assert set(schedule_names("auto")) - set(schedule_names("sync")) == {"ftpipe", "2bw", "wpipe"}
    assert {update_rule(n) for n in ("ftpipe", "2bw", "wpipe")} == {"stale"}
    assert schedule_names(" zb1p, 1f1b") == ["zb1p", "1f1b"]
    with pytest.raises(FtpipeError, match="unknown schedule 'zigzag'; choose from 1f1b, 2bw, auto"):
        schedule_names("1f1b,zigzag")


def test_the_winner_is_the_exhaustive_optimum(problem):
    """Every partitioner under every schedule, nothing skipped: the search's winner (pruned
    by the lower bound only) simulates as fast as the best of all cells."""
    schedules = schedule_names("auto")
    winner, matrix = search_matrix(problem, schedules, width=len(schedules), progress=False)
    every = {}
    for s in schedules:
        cell = next(c for c in matrix if c.schedule == s)
        sub = replace(problem, schedule=s)
        for p in PARTITIONERS:
            every[(s, p)] = evaluate(sub, p, cell.bound_s, 20).step_s
    # the winner simulated again in full (`kept_sim`): the cell's figure to rounding
    assert winner.step_s == pytest.approx(min(every.values()), rel=1e-9)
    for c in matrix:
        if c.status == "ok":
            assert c.step_s == pytest.approx(every[(c.schedule, c.partitioner)], rel=1e-9)
        elif c.status == "pruned":
            # Skipped only because even its bound could not beat the winner.
            assert (
                c.bound_s >= winner.step_s
                and every[(c.schedule, c.partitioner)] >= winner.step_s * 0.99
            )
        else:
            assert c.status != "not searched" and every[(c.schedule, c.partitioner)] == math.inf
    assert winner.plan.schedule == winner.schedule and winner.sim.fits


def test_the_slow_partitioners_run_under_the_fastest_schedules_only(problem):
    schedules = ["gpipe", "1f1b", "zb1p", "interleaved"]
    winner, matrix = search_matrix(problem, schedules, width=1, progress=False)
    cells = {(c.schedule, c.partitioner): c for c in matrix}
    quick = {
        s: min(cells[(s, p)].step_s for p in CHEAP)
        for s in schedules
        if s != "interleaved"  # a loop: only the chain partitioners can cut it
    }
    top = min(quick, key=quick.get)
    for (s, p), c in cells.items():
        if p in CHEAP or s == "interleaved":
            assert c.status != "not searched"
        elif s == top:
            assert c.status in {"ok", "pruned", "infeasible", "does not fit"}
        else:
            assert c.status == "not searched" and f"({quick[s]:.4g} s)" in c.note
    assert winner.step_s == min(c.step_s for c in matrix)
    # Deterministic: the same problem gives the same matrix.
    again = search_matrix(problem, schedules, width=1, progress=False)[1]
    strip = lambda c: {k: v for k, v in c.to_json().items() if k != "search_seconds"}  # noqa: E731
    assert [strip(c) for c in again] == [strip(c) for c in matrix]


def test_workers_give_the_matrix_of_one_process(problem):
    """Two forked workers evaluating ahead give the matrix and the plan that one process
    evaluating each cell in its turn gives: pruning, ranking and the winner alike."""
    schedules = schedule_names("auto")
    serial, one = search_matrix(problem, schedules, width=2, workers=1)
    parallel, two = search_matrix(problem, schedules, width=2, workers=2)
    strip = lambda c: {k: v for k, v in c.to_json().items() if k != "search_seconds"}  # noqa: E731
    assert [strip(c) for c in two] == [strip(c) for c in one]
    assert {c.status for c in one} >= {"ok", "not searched"}  # the search was not trivial
    plan = lambda cell: {**cell.plan.to_dict(), "search_seconds": 0}  # noqa: E731
    assert plan(parallel) == plan(serial) and parallel.sim == serial.sim


FakeSim = namedtuple("FakeSim", "step_time_s")  # what the search reads of a simulation
FakePlan = namedtuple("FakePlan", "comm_bytes")  # and of a plan


def test_workers_prune_as_one_process(problem, monkeypatch):
    """With cells finishing out of order (each takes its own time), some cells pruned by a
    best step found earlier in the serial order: the same matrix from 1 and 2 workers."""
    import ftpipe_compiler.planner.matrix as matrix

    order = {(s, p): i for i, (s, p) in enumerate(product(SCHEDULES, PARTITIONERS))}

    def evaluate(sub, partitioner, bound, steps):
        i = order[(sub.schedule, partitioner)]
        time.sleep(0.01 * (i * 7 % 5))  # later cells may finish first
        step = bound * (1.0 if i % 4 == 1 else 1.2)  # some plans reach the bound: prune the rest
        return Cell(sub.schedule, partitioner, "ok", bound, FakePlan(i), FakeSim(step))

    monkeypatch.setattr(matrix, "evaluate", evaluate)  # the workers fork with it
    monkeypatch.setattr(matrix, "kept_sim", lambda plan, steps: None)  # plans are fakes
    one = search_matrix(problem, SCHEDULES, width=2, workers=1)[1]
    two = search_matrix(problem, SCHEDULES, width=2, workers=2)[1]
    assert two == one
    assert {c.status for c in one} >= {"ok", "pruned", "not searched"}


def test_a_worker_stopped_by_sigterm_stops_the_search(problem, monkeypatch, capfd):
    """SIGTERM reaching a worker mid-cell (`kill`, or the whole process group stopped): the
    worker ends at once and quietly, and the search stops as SIGTERM stops ftpipe
    (Terminated: one line and 143 from the command). Forked with the command's SIGTERM
    handler, the worker raised Terminated inside multiprocessing's code: the cell "failed"
    with it while the worker lived on waiting for work, or it printed a traceback."""
    import ftpipe_compiler.planner.matrix as matrix

    monkeypatch.setattr(matrix, "evaluate", lambda *args: time.sleep(60))  # forked with it
    old = signal.signal(signal.SIGTERM, signal.SIG_DFL)
    catch_sigterm()  # as the command does before the workers fork
    try:
        with matrix.CellPool(lambda key: matrix.evaluate(problem, key[1], 1.0, 20), 2) as cells:
            cells.want([("1f1b", "even-layers"), ("1f1b", "params")])
            # this pool's own worker: active_children() lists every child of the process,
            # an earlier test's pool's among them (CI once killed one of those and waited)
            worker = cells._processes()[0]
            time.sleep(0.5)  # its cell begun
            os.kill(worker.pid, signal.SIGTERM)
            worker.join(timeout=10)
            assert worker.exitcode == -signal.SIGTERM
            t0 = time.monotonic()
            with pytest.raises(Terminated):
                cells.result(("1f1b", "even-layers"))
        assert time.monotonic() - t0 < 30  # the other worker stopped, not waited for
    finally:
        signal.signal(signal.SIGTERM, old)
    assert not multiprocessing.active_children()
    assert capfd.readouterr().err == ""


_SIGNAL_AFTER_FORK: list[int] = []  # the next fork in this process sends itself this signal
_HOOKED: list[bool] = []  # (an at-fork hook cannot be removed: registered once, one-shot)


def _signal_after_fork() -> None:
    if _SIGNAL_AFTER_FORK:
        os.kill(os.getpid(), _SIGNAL_AFTER_FORK.pop())


@pytest.mark.parametrize("sig, stop", [(signal.SIGTERM, Terminated), (signal.SIGINT, KeyboardInterrupt)], ids=["SIGTERM", "Ctrl-C"])  # fmt: skip
def test_a_signal_while_the_workers_fork_stops_the_search(problem, monkeypatch, capfd, sig, stop):
    """SIGTERM (or Ctrl-C) that came while the pool forked its workers (a T5-3B compile is
    gigabytes: each fork takes a while) was handled in fork's at-fork hooks, where Python
    drops the exception ("Exception ignored in: <function _releaseLock>"): the audit's compile
    went on to the end, replaced its output and exited 0. It stops the search."""
    import ftpipe_compiler.planner.matrix as matrix

    if not _HOOKED:
        os.register_at_fork(after_in_parent=_signal_after_fork)
        _HOOKED.append(True)
    monkeypatch.setattr(matrix, "evaluate", lambda *args: time.sleep(60))  # forked with it
    old = signal.signal(signal.SIGTERM, signal.SIG_DFL)
    catch_sigterm()  # as the command does
    try:
        _SIGNAL_AFTER_FORK.append(sig)
        t0 = time.monotonic()
        with pytest.raises(stop):
            with matrix.CellPool(lambda key: matrix.evaluate(problem, key[1], 1.0, 20), 2) as cells:
                cells.want([("1f1b", "even-layers"), ("1f1b", "params")])
                cells.result(("1f1b", "even-layers"))
        assert time.monotonic() - t0 < 30  # the workers stopped, not waited for
    finally:
        _SIGNAL_AFTER_FORK.clear()
        signal.signal(signal.SIGTERM, old)
    assert not multiprocessing.active_children()
    assert capfd.readouterr().err == ""


def test_nothing_fits(problem):
    tiny = replace(problem, memory_bytes=1000)
    with pytest.raises(FtpipeError, match="no schedule and partitioner give a plan that fits"):
        search_matrix(tiny, ["1f1b", "zb1p"], progress=False)


def test_only_the_winners_lists_are_validated(problem, monkeypatch):
    """The cells' simulations skip the list check (the runtime's `validate`); the winner's
    lists are checked before the search returns, so a schedule making lists that do not
    hold stops it."""
    from ftpipe_runtime.schedules import ScheduleError

    import ftpipe_compiler.simulate.simulator as simulator

    checked = []

    def refuse(lists, graph, schedule, m, steps):
        checked.append(schedule.name)
        raise ScheduleError("these action lists deadlock: a test's refusal")

    monkeypatch.setattr(simulator, "validate", refuse)
    with pytest.raises(FtpipeError, match="a test's refusal"):
        search_matrix(problem, ["1f1b", "ftpipe"], workers=1, progress=False)
    assert len(checked) == 1  # the winner's only
