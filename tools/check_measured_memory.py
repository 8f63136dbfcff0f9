"""Does measured profiling stay within --memory-limit on a model that does not fit in it?

    python tools/check_measured_memory.py                       # t5-large, 1 GB, on CPU
    python tools/check_measured_memory.py --model t5-base --limit 0.25

Runs `ftpipe profile --profile measured --granularity layer --memory-limit GB` in a fresh
process twice: on a tiny model, whose peak RSS is the fixed overhead (python, torch,
transformers, tracing, the profiler itself), then on the big model. Prints the figures and
exits 1 unless the big model's full fp32 training footprint (16 bytes a parameter:
weights, gradients, two Adam moments) is at least 4x the limit and its peak RSS stays
under limit + overhead.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

MB = 1e6


def child(args: list[str]) -> None:
    """Run the CLI in this process and print what its memory did, as JSON."""
    from ftpipe_runtime.job.memory import peak_resident_bytes

    from ftpipe_compiler.cli import cli
    from ftpipe_compiler.graph.opgraph import OpGraph

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "graph.json"
        cli.main(args=["profile", *args, "-o", str(out)], standalone_mode=False)
        peak = peak_resident_bytes()
        graph = OpGraph.load(out)
    m = graph.meta["measured"]
    print(
        json.dumps(
            {
                "peak_rss": peak,
                "rss_before_profiling": m["rss_before_bytes"],
                "largest_block": m["largest_block"],
                "param_bytes": graph.param_bytes,
                "parameters": graph.num_parameters,
                "act_bytes": sum(n.act_bytes for n in graph.nodes),
                "seconds": m["seconds"],
                "blocks": len(graph.nodes),
            }
        )
    )


def profile(model: str, limit: float, seq_len: int, repeats: int, task: str | None) -> dict:
    cmd = [sys.executable, __file__, "--child", "--model", model, "--profile", "measured"]
    cmd += ["--granularity", "layer", "--memory-limit", str(limit), "--micro-batch", "1"]
    cmd += ["--seq-len", str(seq_len), "--repeats", str(repeats), "--no-cache"]
    cmd += ["--task", task] if task else []
    print("$", " ".join(cmd[1:]), file=sys.stderr, flush=True)
    done = subprocess.run(cmd, capture_output=True, text=True, env=os.environ)
    if done.returncode:
        sys.exit(f"profiling {model} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> int:
    if "--child" in sys.argv:
        child([a for a in sys.argv[1:] if a != "--child"])
        return 0
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="t5-large")
    ap.add_argument("--task", default="rte")
    ap.add_argument("--limit", type=float, default=1.0, help="--memory-limit in GB")
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--tiny", default="t5-tiny", help="the model whose peak RSS is the overhead")
    a = ap.parse_args()
    tiny = profile(a.tiny, a.limit, 16, a.repeats, None)
    big = profile(a.model, a.limit, a.seq_len, a.repeats, a.task)
    limit = a.limit * 1e9
    footprint = big["param_bytes"] * 4  # fp32 weights + gradients + Adam's two moments
    overhead = tiny["peak_rss"]
    growth = big["peak_rss"] - big["rss_before_profiling"]
    slack = tiny["peak_rss"] - tiny["rss_before_profiling"]
    rows = [
        ("model", f"{a.model}: {big['parameters'] / 1e6:,.0f} M parameters, {big['blocks']} blocks"),
        ("training footprint", f"{footprint / MB:,.0f} MB = {footprint / limit:.1f}x the limit"),
        ("memory limit", f"{limit / MB:,.0f} MB"),
        ("largest block", f"{big['largest_block']['scope']}: {big['largest_block']['bytes'] / MB:,.0f} MB"),
        ("fixed overhead", f"{overhead / MB:,.0f} MB (peak RSS profiling {a.tiny})"),
        ("peak RSS", f"{big['peak_rss'] / MB:,.0f} MB (limit + overhead = {(limit + overhead) / MB:,.0f} MB)"),
        ("RSS before profiling", f"{big['rss_before_profiling'] / MB:,.0f} MB (python, torch, traced program)"),
        ("growth while profiling", f"{growth / MB:,.0f} MB (largest block + {a.tiny}'s growth = "
                                   f"{(big['largest_block']['bytes'] + slack) / MB:,.0f} MB)"),
        ("profiling time", f"{big['seconds']:.0f} s"),
    ]  # fmt: skip
    for k, v in rows:
        print(f"{k:>24}: {v}")
    ok = footprint >= 4 * limit and big["peak_rss"] <= limit + overhead
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
