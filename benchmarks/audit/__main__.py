"""`python -m benchmarks.audit [-k WORDS] [--out docs/reliability.md]`: run the audit's cases
(two at a time: the machine's cores), print each result, and write the table.

Exit status 0 when every case passed, 1 otherwise (the table is written either way, unless
-k chose some cases only: then only with --out given)."""

from __future__ import annotations

import argparse
import os
import re
import signal
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from benchmarks.harness.launch import ROOT

from .cases_compiler import CASES as COMPILER
from .cases_faults import CASES as FAULTS
from .cases_runtime import CASES as RUNTIME
from .harness import run_case, snapshot
from .report import markdown
from .workspace import build

CASES = [*COMPILER, *RUNTIME, *FAULTS]
LANES = 2


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.audit", description=__doc__)
    ap.add_argument("-k", default=None, help="only the cases whose name matches this regex")
    ap.add_argument("--out", type=Path, default=None, help="default docs/reliability.md")
    ap.add_argument("--work", type=Path, default=None, help="where the cases run (a temp dir)")
    ap.add_argument("--keep", action="store_true", help="keep each case's folder")
    ap.add_argument("--lanes", type=int, default=LANES, help="cases at a time")
    args = ap.parse_args(argv)
    chosen = [c for c in CASES if args.k is None or re.search(args.k, c.name)]
    names = [c.name for c in CASES]
    if len(set(names)) != len(names):
        raise SystemExit("audit: two cases share a name")
    work = args.work or Path(tempfile.mkdtemp(prefix="ftpipe-audit-"))
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    # Started in the background, this process ignores SIGINT, and so would every child it
    # starts: the Ctrl-C cases need it back to its default.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    start = time.perf_counter()
    base = build(work / "base", say=lambda line: print(line, flush=True))
    shared = snapshot(base)

    def one(i_case):
        i, case = i_case
        result = run_case(case, base, work / f"case-{i:03d}", keep=args.keep)
        mark = "skip" if result.skipped else ("ok" if result.ok else "FAIL")
        codes = ",".join(map(str, result.codes))
        print(f"{mark:4} {i:3} {case.name} [{codes}] {result.seconds:.1f}s "
              f"{result.message[:100]!r} {'; '.join(result.problems)}", flush=True)  # fmt: skip
        return result

    with ThreadPoolExecutor(args.lanes) as pool:
        results = list(pool.map(one, [(CASES.index(c), c) for c in chosen]))
    base_intact = snapshot(base) == shared
    wall = time.perf_counter() - start
    failed = [r for r in results if r.problems]
    print(f"audit: {len(results)} cases, {len(failed)} failed, {wall:.0f} s"
          f"{'' if base_intact else '; THE SHARED WORKSPACE CHANGED'}")  # fmt: skip
    out = args.out or (None if args.k else ROOT / "docs" / "reliability.md")
    if out is not None:
        out.write_text(markdown(results, wall=wall, base_intact=base_intact))
        print(f"wrote {out}")
    return 1 if failed or not base_intact else 0


if __name__ == "__main__":
    sys.exit(main())
