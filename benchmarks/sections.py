"""The sections of BENCHMARKS.md and how their parts run (see `benchmarks.__main__`)."""

from __future__ import annotations

import datetime
import importlib
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from multiprocessing import get_context

import torch

LANES = 2  # compute-only parts at a time: one per core


@dataclass(frozen=True)
class Section:
    """A BENCHMARKS.md section: its parts, `name -> (measure() -> dict, alone)` (`alone`:
    it times processes, so nothing else may run meanwhile), how the parts' results make the
    section's data (default: the only part's result, else a dict of them), its markdown."""

    markdown: object
    parts: dict = field(default_factory=dict)
    combine: object = None

    @classmethod
    def of(cls, package) -> Section:
        """From a section's package: its markdown, and from its bench module PARTS (or
        measure and ALONE) and combine."""
        bench = package.bench
        parts = getattr(bench, "PARTS", None) or {"": (bench.measure, bench.ALONE)}
        return cls(package.markdown, parts, getattr(bench, "combine", None))

    def data(self, results: dict) -> dict:
        if self.combine is not None:
            return self.combine(results)
        return results[""] if list(results) == [""] else dict(results)


# BENCHMARKS.md's order
NAMES = ["plans", "schedules", "zero_bubble", "compile", "runtime", "fidelity", "planner"]
NAMES += ["allreduce", "startup", "freeze", "lora", "memory", "offload"]
SECTIONS = {name: Section.of(importlib.import_module(f"benchmarks.{name}")) for name in NAMES}


def _timed(measure) -> tuple[dict, float]:
    t0 = time.perf_counter()
    return measure(), time.perf_counter() - t0


def _one_thread() -> None:
    torch.set_num_threads(1)


def run_sections(names: list[str], sections=SECTIONS, previous=None) -> dict[str, dict]:
    """Every part of the named sections: the compute-only ones LANES at a time in child
    processes, longest first by `previous` (the last run's data: its part_seconds), then
    the ones that need the machine alone, here, one after the other."""
    jobs = [(s, p, *sections[s].parts[p]) for s in names for p in sections[s].parts]
    last = {
        (s, p): t for s, d in (previous or {}).items() for p, t in d.get("part_seconds", {}).items()
    }
    shared = sorted((j for j in jobs if not j[3]), key=lambda j: -last.get(j[:2], 0.0))
    results: dict[str, dict] = {s: {} for s in names}
    seconds: dict[str, dict] = {s: {} for s in names}
    if shared:
        say = ", ".join(f"{s}:{p}" if p else s for s, p, *_ in shared)
        print(f"bench: {say} ({LANES} at a time)", file=sys.stderr, flush=True)
        with ProcessPoolExecutor(LANES, get_context("spawn"), initializer=_one_thread) as pool:
            futures = [(s, p, pool.submit(_timed, fn)) for s, p, fn, _ in shared]
            for s, p, f in futures:
                results[s][p], seconds[s][p] = f.result()
    for s, p, fn, alone in jobs:
        if alone:
            print(f"bench: {s}" + (f":{p}" if p else ""), file=sys.stderr, flush=True)
            results[s][p], seconds[s][p] = _timed(fn)
    out = {}
    for s in names:
        out[s] = sections[s].data(results[s])
        out[s]["bench_seconds"] = sum(seconds[s].values())
        out[s]["part_seconds"] = seconds[s]
        out[s]["measured_on"] = str(datetime.date.today())
    return out
