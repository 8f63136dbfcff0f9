"""`make bench`: measure ftpipe against its peers and write BENCHMARKS.md (+ a JSON of raw figures).

    python -m benchmarks --out BENCHMARKS.md                 # everything (~20 min on 2 cores)
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
  planner   the data x pipeline shape for T5-11B on 64 and T5-3B on 16 GPUs, planning time
  allreduce gloo all-reduce on this machine against the simulator's ring model
  lora      Llama-3.1-8B on 4 x RTX 4090: full fine-tuning against LoRA, simulated
  memory    each rank's peak memory against its plan: a Qwen2.5-0.5B-shaped model on 2 CPU
            ranks under ftpipe (bf16) and 2bw (fp32), with evaluation (needs ~17 GB free)
  offload   host offload chosen per stage: Llama-3.1-8B, Qwen2.5-14B-shaped and T5-11B on
            RTX 4090s, simulated; the offload path's cost on 2 CPU ranks, measured

Parts of sections that only compute (planning, simulating, and the timed parts' set-up:
analytic compiles, models and weights written; one thread each) run first, two at a time, one
per core of this 2-core machine; then every part that times processes on the machine (ranks
started as torchrun starts them, startup, all-reduce, compile) runs alone, one after the other.
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

from benchmarks.sections import LANES, SECTIONS, run_sections
from ftpipe_compiler.version import __version__


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
    t0 = time.perf_counter()
    raw.update(run_sections(names, SECTIONS, previous=raw))
    print(f"bench: {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    parts = [SECTIONS[s].markdown(raw[s]) for s in SECTIONS if s in raw]
    head = [
        "# ftpipe benchmarks",
        "",
        f"Written by `make bench` (`python -m benchmarks`) on {datetime.date.today()}, ftpipe {__version__}, "
        f"torch {torch.__version__}, Python {platform.python_version()}, {platform.machine()}. "
        f"Raw figures: `{Path(args.out).with_suffix('.json').name}`. Planning and simulation "
        f"ran {LANES} at a time (one thread each), everything timed on processes alone.",
        "",
    ]
    # Both files, each whole: an interrupted or failed bench leaves the previous ones as they were.
    write_atomic(out_json, json.dumps(raw, indent=1))
    write_atomic(args.out, "\n".join(head + parts))
    print(f"wrote {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
