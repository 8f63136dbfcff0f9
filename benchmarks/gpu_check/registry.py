"""The parts of the GPU check, each registered by name, and how they run: each under its own
time budget, each failure its own (recorded; the next part runs all the same).

    @part("fused_loss", "Fused LM-head loss", cuda_s=40, cpu_s=10, needs=("compiler",))
    def fused_loss(check: Check, found: Findings) -> None:
        found["tokens"] = ...                      # figures for the report
        found.expect(fused < unfused, "the fused loss used more memory than the unfused")
        raise Skip("why it cannot run here")        # skipped, with its reason

A part that raises records its error and the traceback's last line; one that runs past its
budget is interrupted (SIGALRM) and recorded as timed out. A part's figures stay in
`check.results` for the parts after it (the calibration reads the Llama run's step).
"""

from __future__ import annotations

import signal
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["PARTS", "Check", "Findings", "Part", "Skip", "part", "run_parts"]

# A part's `needs` -> the modules it takes (the compiler imports pymetis on import).
NEEDS = {"compiler": ("ftpipe_compiler", "pymetis")}
MIN_BUDGET_S = 3.0  # a part with less time than this left is skipped, not started


class Skip(Exception):
    """This part cannot run here (no GPU, a package missing): the reason."""


class _OutOfTime(BaseException):  # BaseException: a part's own `except Exception` lets it by
    pass


class Findings(dict):
    """A part's figures, and the checks among them that failed (`problems`)."""

    def __init__(self):
        super().__init__()
        self.problems: list[str] = []

    def expect(self, ok: bool, problem: str) -> bool:
        if not ok:
            self.problems.append(problem)
        return bool(ok)


@dataclass
class Check:
    """What every part shares: the device, its sizes, a work folder, the clock."""

    device: str  # "cuda" or "cpu"
    sizes: object  # sizes.Sizes for this device
    work: Path
    deadline: float  # time.monotonic() by which everything must be done
    started: float = field(default_factory=time.monotonic)
    results: dict = field(default_factory=dict)  # part name -> its Findings, as they finish
    cache: dict = field(default_factory=dict)  # what parts share (compiled packages)
    notes: list = field(default_factory=list)  # set-up lines (bootstrap)
    slack: float = 1.0  # every part's own budget times this (a slow or busy machine)

    def say(self, line: str) -> None:
        """A progress line with the seconds since the start (stderr, unbuffered)."""
        print(f"[gpu-check +{time.monotonic() - self.started:6.1f}s] {line}", file=sys.stderr,
              flush=True)  # fmt: skip

    def left(self) -> float:
        return self.deadline - time.monotonic()


@dataclass(frozen=True)
class Part:
    name: str
    title: str
    run: Callable[[Check, Findings], None]
    budget_s: dict  # device -> seconds at most
    needs: tuple[str, ...] = ()  # modules it imports ("compiler": `NEEDS`)


PARTS: dict[str, Part] = {}


def part(name: str, title: str, *, cuda_s: float, cpu_s: float, needs=()):
    """Register a part under `name` (the order of registration is the order of the run)."""

    def register(fn):
        PARTS[name] = Part(name, title, fn, {"cuda": cuda_s, "cpu": cpu_s}, tuple(needs))
        return fn

    return register


def _interrupt(signum, frame):
    raise _OutOfTime


def run_one(check: Check, p: Part) -> dict:
    """One part, timed and fenced: its row of the report."""
    from .bootstrap import missing

    row = {"name": p.name, "title": p.title, "budget_s": 0.0, "seconds": 0.0, "problems": []}
    found = Findings()
    lacking = missing(*(m for n in p.needs for m in NEEDS.get(n, (n,))))
    budget = min(p.budget_s[check.device] * check.slack, check.left())
    row["budget_s"] = round(budget, 1)
    if lacking:
        reason = f"{', '.join(lacking)} cannot be imported here"
        if "pymetis" in lacking:
            reason += " (the compiler imports it: `make gpu-wheels` here, then carry .whl)"
        return {**row, "status": "skipped", "reason": reason, "figures": {}}
    if budget < MIN_BUDGET_S:
        return {**row, "status": "skipped", "reason": "out of time: the check's budget is spent",
                "figures": {}}  # fmt: skip
    check.say(f"{p.name}: {p.title} (at most {budget:.3g} s)")
    start = time.monotonic()
    previous = signal.signal(signal.SIGALRM, _interrupt)
    signal.setitimer(signal.ITIMER_REAL, budget)
    try:
        p.run(check, found)
        status = "failed" if found.problems else "passed"
        extra = {}
    except Skip as e:
        status, extra = "skipped", {"reason": str(e)}
    except _OutOfTime:
        status, extra = "timed out", {"reason": f"still running after its {budget:.3g} s"}
    except Exception as e:  # noqa: BLE001 - recorded; the next part runs all the same
        last = traceback.format_exc().strip().splitlines()
        status, extra = "error", {"reason": f"{type(e).__name__}: {e}"[:2000],
                                  "traceback": last[-12:]}  # fmt: skip
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    row["seconds"] = round(time.monotonic() - start, 2)
    check.results[p.name] = found
    check.say(f"{p.name}: {status} in {row['seconds']:.1f} s" + (
        f" ({extra['reason']})" if extra.get("reason") else ""))  # fmt: skip
    for problem in found.problems:
        check.say(f"{p.name}: problem: {problem}")
    _free(check)
    return {**row, "status": status, **extra, "problems": found.problems, "figures": dict(found)}


def _free(check: Check) -> None:
    """What a part left on the GPU goes back before the next one measures memory."""
    import gc

    gc.collect()
    if check.device == "cuda":
        import torch

        try:
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
        except RuntimeError as e:  # a part left the GPU broken: the next parts will say so
            check.say(f"the GPU after that part: {e}")


def run_parts(check: Check, names: list[str]) -> list[dict]:
    return [run_one(check, PARTS[n]) for n in names]
