"""`make gpu-check`: everything that needs a GPU, in one command, within 8 minutes on one
H100 or H200; on a CPU the same parts at tiny sizes (`make test` runs that version).

    python -m benchmarks.gpu_check                        # cuda if torch sees a GPU, else cpu
    python -m benchmarks.gpu_check --device cpu --out out/GPU_CHECK.md --budget 240
    python -m benchmarks.gpu_check --parts environment,rates

Writes GPU_CHECK.md and GPU_CHECK.json beside it (on a CPU under out/, so that the small
version never replaces a GPU's report; docs/gpu-check.md says what to do with them). Each part runs under its own budget; one that fails, errs or runs out of time is
recorded and the next runs all the same. Exit status 0 when every part passed or was
skipped with a reason, 1 otherwise. Progress goes to stderr with timestamps.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import tempfile
import time
from pathlib import Path

from . import bootstrap

DEFAULT_BUDGET_S = {"cuda": 450.0, "cpu": 240.0}


def parse(argv) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="python -m benchmarks.gpu_check",
        description=__doc__.splitlines()[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto")
    ap.add_argument("--out", default=None, help="the report, its .json beside it (default: "
                    "GPU_CHECK.md on a GPU, out/GPU_CHECK.md on a CPU)")  # fmt: skip
    ap.add_argument("--budget", type=float, default=None,
                    help="seconds for everything (default 450 on a GPU, 240 on a CPU)")  # fmt: skip
    ap.add_argument("--slack", type=float, default=1.0,
                    help="multiply every part's own budget (a slow or busy machine)")  # fmt: skip
    ap.add_argument("--parts", default=None, help="comma-separated subset (default: all)")
    ap.add_argument("--work", default=None, help="scratch folder (default: a temporary one)")
    return ap.parse_args(argv)


def main(argv=None) -> int:
    args = parse(argv)
    start = time.monotonic()
    work = Path(args.work or tempfile.mkdtemp(prefix="gpu-check-"))
    notes = bootstrap.importable(work / "site")  # before anything imports ftpipe

    import torch

    from . import parts  # noqa: F401 - registers every part
    from .calibration import propose
    from .packages import hardware_for
    from .registry import PARTS, Check, run_parts
    from .report import FORMAT, KIND, markdown, summary_line
    from .sizes import SIZES

    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        print("--device cuda, but torch sees no GPU here; use --device cpu", file=sys.stderr)
        return 2
    names = [n.strip() for n in (args.parts or ",".join(PARTS)).split(",") if n.strip()]
    unknown = [n for n in names if n not in PARTS]
    if unknown:
        print(f"unknown part {unknown[0]!r}; choose from {', '.join(PARTS)}", file=sys.stderr)
        return 2
    _preload()  # before any part's clock: an import cut short by a budget breaks the rest
    budget = args.budget or DEFAULT_BUDGET_S[device]
    check = Check(device, SIZES[device], work, start + budget, started=start, notes=notes,
                  slack=args.slack)  # fmt: skip
    for line in notes:
        check.say(line)
    check.say(f"{len(names)} parts on {device}, {budget:.0f} s in all; scratch in {work}")
    rows = run_parts(check, names)
    date = datetime.date.today().isoformat()
    report = {
        "kind": KIND,
        "format": FORMAT,
        "date": date,
        "device": device,
        "command": "python -m benchmarks.gpu_check " + " ".join(argv or sys.argv[1:]),
        "budget_s": budget,
        "wall_s": round(time.monotonic() - start, 1),
        "parts": rows,
        "calibration": propose(rows, hardware_for(device), date) if device == "cuda" else None,
    }
    from ftpipe_runtime.atomic import write_atomic

    out = Path(args.out or ("GPU_CHECK.md" if device == "cuda" else "out/GPU_CHECK.md"))
    out.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(out.with_suffix(".json"), json.dumps(report, indent=1, default=str))
    write_atomic(out, markdown(report))
    check.say(f"wrote {out} and {out.with_suffix('.json').name}: {summary_line(report)}")
    ok = all(p["status"] in ("passed", "skipped") for p in rows)
    return 0 if ok else 1


def _preload() -> None:
    """Import what the parts import lazily and slowly (torch's compiler stack: the optimizer's
    first step and torch.export pull it in; transformers; the compiler), so that no part's
    budget interrupts an import halfway (a half-imported module breaks every later part)."""
    import importlib

    from .bootstrap import missing

    for name in ("torch._dynamo", "torch.export", "transformers", "ftpipe_compiler.cli"):
        if not missing(name.split(".")[0]):
            try:
                importlib.import_module(name)
            except Exception:  # noqa: BLE001 - the part that needs it will say why
                pass


if __name__ == "__main__":
    sys.exit(main())
