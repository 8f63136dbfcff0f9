"""`make bench`: measure ftpipe against its peers and write BENCHMARKS.md (+ a JSON of raw figures).

    python -m benchmarks --out BENCHMARKS.md                 # everything (~32 min on 2 cores)
    python -m benchmarks --sections plans,compile --out B.md # a subset

Sections:
  plans     every partitioner on the paper's models and hardware, simulated (analytic costs)
  schedules gpipe, 1f1b, 2bw, wpipe and ftpipe side by side on T5-3B and BERT-large
  zero_bubble  zb1p, zbv, interleaved (and gpipe, 1f1b) vs torch.distributed.pipelining's
            same-named schedules on 2 CPU ranks; partition x schedule vs 1F1B, simulated
  compile   trace / profile / partition / simulate / codegen seconds for T5-3B
  runtime   the generated package vs torch.distributed.pipelining, an even split, one process
  fidelity  simulated vs measured step time of generated packages on CPU (measured profile)
  startup   seconds to the first step for --steps 100000 against --steps 10
  freeze    PipeTransformer's freeze training on elastic pipelines: BERT-large simulated, and a
            4-rank tiny BERT measured switching from 1 x 4 to 2 x 2 GPUs
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import sys
import time
from pathlib import Path

import torch
from ftpipe_runtime.atomic import write_atomic

from benchmarks import (
    allreduce,
    compile,
    fidelity,
    freeze,
    lora,
    planner,
    plans,
    runtime,
    schedules,
    startup,
    zero_bubble,
)
from ftpipe_compiler.version import __version__

SECTIONS = {  # name -> (measure() -> dict, markdown(dict) -> str), in BENCHMARKS.md's order
    name: (module.measure, module.markdown)
    for name, module in [
        ("plans", plans),
        ("schedules", schedules),
        ("zero_bubble", zero_bubble),
        ("compile", compile),
        ("runtime", runtime),
        ("fidelity", fidelity),
        ("planner", planner),
        ("allreduce", allreduce),
        ("startup", startup),
        ("freeze", freeze),
        ("lora", lora),
    ]
}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--sections", default=",".join(SECTIONS))
    ap.add_argument("--out", default="BENCHMARKS.md")
    args = ap.parse_args(argv)
    names = [s.strip() for s in args.sections.split(",") if s.strip()]
    for s in names:
        if s not in SECTIONS:
            sys.exit(f"unknown section {s!r}; choose from {', '.join(SECTIONS)}")
    out_json = Path(args.out).with_suffix(".json")
    # Sections not measured this time keep their figures from the last run, so one section can
    # be measured again alone (`--sections startup`) without losing the others.
    try:
        raw = {k: v for k, v in json.loads(out_json.read_text()).items() if k in SECTIONS}
    except (OSError, ValueError):
        raw = {}
    for s in names:
        t0 = time.perf_counter()
        print(f"bench: {s}", file=sys.stderr, flush=True)
        measure, _ = SECTIONS[s]
        raw[s] = measure()
        raw[s]["bench_seconds"] = time.perf_counter() - t0
        raw[s]["measured_on"] = str(datetime.date.today())
    parts = [render(raw[s]) for s, (_, render) in SECTIONS.items() if s in raw]
    head = [
        "# ftpipe benchmarks",
        "",
        f"Written by `make bench` (`python -m benchmarks`) on {datetime.date.today()}, ftpipe {__version__}, "
        f"torch {torch.__version__}, Python {platform.python_version()}, {platform.machine()}. "
        f"Raw figures: `{Path(args.out).with_suffix('.json').name}`.",
        "",
    ]
    # Both files, each whole: an interrupted or failed bench leaves the previous ones as they were.
    write_atomic(out_json, json.dumps(raw, indent=1))
    write_atomic(args.out, "\n".join(head + parts))
    print(f"wrote {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
