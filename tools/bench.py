"""`make bench`: measure ftpipe against its peers and write BENCHMARKS.md (+ a JSON of raw figures).

    python tools/bench.py --out BENCHMARKS.md                 # everything (~32 min on 2 cores)
    python tools/bench.py --sections plans,compile --out B.md # a subset

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

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_allreduce  # noqa: E402
import bench_fidelity  # noqa: E402 - sections 3 and 4 live beside this file
import bench_freeze  # noqa: E402
import bench_lora  # noqa: E402
import bench_planner  # noqa: E402
import bench_runtime  # noqa: E402
import bench_schedules  # noqa: E402
import bench_startup  # noqa: E402
import bench_zero_bubble  # noqa: E402
from ftpipe_runtime.atomic import write_atomic  # noqa: E402

from ftpipe_compiler.costs.profilers import costed_graph  # noqa: E402
from ftpipe_compiler.partition import problem_from_graph, run_partitioners  # noqa: E402
from ftpipe_compiler.simulate import simulate  # noqa: E402
from ftpipe_compiler.version import __version__  # noqa: E402

SEQUENTIAL = ("pipedream", "acyclic", "gpipe", "params")
# (model, task, hardware, gpus): the paper's machine, and V100 boxes of 4 and 8.
PLAN_CASES = [
    ("t5-3b", "rte", "rtx2080ti", 8),
    ("t5-3b", "boolq", "rtx2080ti", 8),
    ("t5-3b", "rte", "v100-32gb", 4),
    ("t5-11b", "rte", "v100-32gb", 8),
    ("gpt2-xl", "wikitext2", "rtx2080ti", 8),
    ("gpt2-xl", "wikitext2", "v100-32gb", 4),
    ("bert-large", "squad", "rtx2080ti", 8),
    ("bert-large", "squad", "v100-32gb", 4),
]


def bench_plans(cases=PLAN_CASES, schedule="ftpipe", steps=20) -> dict:
    out = []
    for model, task, hardware, gpus in cases:
        t0 = time.perf_counter()
        spec, t, _, graph = costed_graph(model, task, hardware)
        problem = problem_from_graph(graph, gpus, hardware, schedule, None, None, 0)
        results = run_partitioners(problem, progress=False)
        rows = []
        for r in results:
            row = r.to_json()
            if r.feasible:
                sim = simulate(r.plan, steps=steps)
                row.update(
                    simulated_step_time_s=sim.step_time_s,
                    samples_per_s=sim.samples_per_s,
                    bubble_fraction=sim.bubble_fraction,
                    fits=sim.fits,
                )
            rows.append(row)
        out.append(
            {
                "model": model,
                "task": t.name,
                "hardware": hardware,
                "gpus": gpus,
                "schedule": schedule,
                "micro_batch": graph.meta["micro_batch"],
                "micro_batches": problem.micro_batches,
                "optimizer": problem.optimizer,
                "nodes": len(graph.nodes),
                "lower_bound_s": problem.lower_bound(),
                "results": rows,
                "seconds": time.perf_counter() - t0,
            }
        )
        print(
            f"  plans: {model} {task} {gpus} x {hardware}: {out[-1]['seconds']:.0f} s",
            file=sys.stderr,
        )
    return {"cases": out}


def plans_markdown(data: dict) -> str:
    lines = [
        "## 1. Plan quality (analytic costs, simulated)",
        "",
        "Every partitioner on the same costed graph, memory model and simulator. *period* is "
        "FTPipe eq. 1 (the slowest GPU's compute plus unhidden transfers, per micro-batch); "
        "*expected speedup* = total compute / period; throughput is the simulator's steady "
        "state under the asynchronous `ftpipe` schedule. Mixed vs best sequential compares "
        "simulated samples/s with the best of pipedream, acyclic, gpipe and params.",
        "",
    ]
    for c in data["cases"]:
        ok = [r for r in c["results"] if r["feasible"] and r.get("fits", True)]
        best = max(ok, key=lambda r: r["samples_per_s"], default=None)
        seq = [r for r in ok if r["partitioner"] in SEQUENTIAL]
        mixed = next((r for r in ok if r["partitioner"] == "mixed"), None)
        lines += [
            f"### {c['model']} ({c['task']}, micro-batch {c['micro_batch']} x {c['micro_batches']}, "
            f"{c['optimizer']}) on {c['gpus']} x {c['hardware']}",
            "",
            f"{c['nodes']:,} nodes; lower bound {c['lower_bound_s'] * 1e3:.1f} ms per micro-batch.",
            "",
            "| partitioner | samples/s (sim) | period ms | / lower bound | expected speedup | stages "
            "| max memory GiB | comm MB | search s |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for r in c["results"]:
            name = f"**{r['partitioner']}**" if best and r is best else r["partitioner"]
            if not r["feasible"]:
                lines.append(
                    f"| {name} | infeasible: {r.get('error', '')} | | | | | | | {r['search_seconds']:.1f} |"
                )
                continue
            lines.append(
                f"| {name} | {r.get('samples_per_s', 0):.2f} | {r['period_s'] * 1e3:.1f} | "
                f"{r['period_s'] / c['lower_bound_s']:.3f} | {r['expected_speedup']:.2f} | {r['stages']} | "
                f"{r['max_memory_bytes'] / 2**30:.2f} | {r['comm_bytes'] / 1e6:.0f} | {r['search_seconds']:.1f} |"
            )
        if mixed and seq:
            top = max(seq, key=lambda r: r["samples_per_s"])
            lines += [
                "",
                f"Mixed-pipe vs best sequential ({top['partitioner']}): "
                f"{mixed['samples_per_s'] / top['samples_per_s']:.2f}x simulated throughput, "
                f"period {top['period_s'] / mixed['period_s']:.2f}x lower.",
            ]
        lines.append("")
    return "\n".join(lines)


def bench_compile(model="t5-3b", gpus=8) -> dict:
    """The phases of `ftpipe compile`, timed by the command itself."""
    import tempfile

    from click.testing import CliRunner

    from ftpipe_compiler.cli import cli

    with tempfile.TemporaryDirectory() as tmp:
        r = CliRunner().invoke(
            cli, ["compile", "--model", model, "--gpus", str(gpus), "-o", f"{tmp}/out", "--json"]
        )
        if r.exit_code != 0:
            raise RuntimeError(r.output)
        data = json.loads(r.output[r.output.index("{") :])
        figures = save_figures(Path(tmp) / "out" / "report.html", FIGURES)
    return {
        "model": model,
        "gpus": gpus,
        "timings": data["timings"],
        "winner": data["winner"],
        "schedule": data["schedule"],
        "figures": figures,
    }


FIGURES = Path(__file__).resolve().parent.parent / "docs"


def save_figures(report: Path, folder: Path) -> list[str]:
    """The report's timeline and memory charts as standalone SVG files, for the README."""
    import re

    html = report.read_text()
    folder.mkdir(exist_ok=True)
    saved = []
    for name in ("timeline", "memory"):
        m = re.search(rf'<svg xmlns="http://www.w3.org/2000/svg" id="{name}".*?</svg>', html, re.S)
        if m:
            path = folder / f"t5-3b-{name}.svg"
            write_atomic(path, m.group(0) + "\n")
            saved.append(str(path.relative_to(folder.parent)))
    return saved


def compile_markdown(data: dict) -> str:
    t = data["timings"]
    return "\n".join(
        [
            f"## 2. Compile time: `ftpipe compile --model {data['model']} --gpus {data['gpus']}`",
            "",
            "| trace + profile | partitioner x schedule, simulated (`--schedule auto`) | generate "
            "| total |",
            "|---:|---:|---:|---:|",
            f"| {t['trace_profile_s']:.1f} s | {t['search_s']:.1f} s | "
            f"{t['generate_s']:.1f} s | {t['total_s']:.1f} s |",
            "",
            "Figures of the winning plan (from its report.html): "
            + ", ".join(f"[{Path(f).name}]({f})" for f in data.get("figures", []))
            + ".",
            "",
            f"Winner: {data['winner']} under {data['schedule']}. Measured on this machine ({platform.processor() or platform.machine()}, "
            f"{torch.get_num_threads()} threads).",
            "",
        ]
    )


SECTIONS = {
    "plans": (bench_plans, plans_markdown),
    "schedules": (bench_schedules.measure, bench_schedules.markdown),
    "zero_bubble": (bench_zero_bubble.measure, bench_zero_bubble.markdown),
    "compile": (bench_compile, compile_markdown),
    "runtime": (bench_runtime.measure, bench_runtime.markdown),
    "fidelity": (bench_fidelity.measure, bench_fidelity.markdown),
    "planner": (bench_planner.measure, bench_planner.markdown),
    "allreduce": (bench_allreduce.measure, bench_allreduce.markdown),
    "startup": (bench_startup.measure, bench_startup.markdown),
    "freeze": (bench_freeze.measure, bench_freeze.markdown),
    "lora": (bench_lora.measure, bench_lora.markdown),
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
        f"Written by `make bench` (tools/bench.py) on {datetime.date.today()}, ftpipe {__version__}, "
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
