"""One rank of a generated package, as `-m <package>` runs it, plus when every step ended.

    cd out/gpt2-bench && torchrun --nproc_per_node 2 -m benchmarks.harness.ftpipe_worker \\
        --package gpt2_bench_pipeline --result run.json -- --steps 6 --device cpu

Rank 0 writes the runtime's summary to --result with `step_ends_s`: the seconds from the
start of training to the end of each step's forwards on the loss stage. The runtime logs
those per step but its summary keeps only their average, and a benchmark wants the spread,
so this wraps `Progress.loss` (the one hook that sees them) before calling `run`. How long
each action took comes from the runtime's own hook (`--trace FILE` among its options).
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys

from ftpipe_runtime.atomic import write_atomic


def main() -> None:
    argv = sys.argv[1:]
    cut = argv.index("--") if "--" in argv else len(argv)
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--package", required=True, help="the generated package (importable here)")
    ap.add_argument("--result", required=True, help="JSON summary written by rank 0")
    args = ap.parse_args(argv[:cut])
    runtime_argv = argv[cut + 1 :]

    sys.path.insert(0, os.getcwd())  # the package sits in the folder torchrun starts in
    package = importlib.import_module(args.package)
    from ftpipe_runtime import report, run

    ends: dict[int, float] = {}
    log_loss = report.Progress.loss

    def loss(progress, step, message):
        log_loss(progress, step, message)
        ends[step] = progress.times[step]

    report.Progress.loss = loss
    summary = run(package.PLAN_PATH, package.STAGES, runtime_argv)  # its path: elastic/ beside
    if int(os.environ.get("RANK", 0)) == 0:
        summary["step_ends_s"] = [ends[k] for k in sorted(ends)]
        write_atomic(args.result, json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
