"""Activation offload's overhead on 2 CPU ranks (issue 35): one plan, trained with and without
`--offload-activations`.

    python -m benchmarks.runtime.act_offload [--rounds 2] [--timed 4]   # JSON on stdout

The runtime section's model (gpt2-bench: 8 blocks, d_model 256, the 50,257-token vocabulary),
compiled for 2 CPU ranks, 4 micro-batches of 2 x 128 tokens, trained under GPipe with the
plan's recompute switched off: the first stage keeps its autograd graphs, so what it saves
is what moves (the loss stage's backward follows its forward at once: nothing to move).
Three configurations: without offload; with it at its default threshold (saved tensors of 1
MiB and more go to the host); and with every saved tensor offloaded
(`--offload-activations-min 0`), the path's cost at its most. On a CPU the "host" is the
same memory, so this measures what the path costs (hooks, copies, bookkeeping), not what it
saves; the summary's `activation_offload` says how many bytes went each way. The runs
alternate in order over the rounds (`run_rounds`), each timing its steady steps (`WINDOW`).
This machine is shared, so beside the step times (which others' load disturbs), each run's
`--trace` gives the CPU seconds its forwards and backwards took per step, both ranks
together (the copies run on the ranks' main threads here): the path's cost, less disturbed.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from ftpipe_runtime.atomic import write_atomic

from benchmarks.harness.actions import load_actions, summarise
from benchmarks.harness.launch import ROOT, compile_plan, run_package
from benchmarks.harness.stats import run_rounds, step_times, summarise_steps

MODEL, SCHEDULE = "gpt2-bench", "gpipe"
WINDOW = (2, 1)  # untimed steps: the first two (warm-up), the last (nothing overlaps it)
CONFIGS = {
    "plain": [],
    "offload": ["--offload-activations"],
    "offload-all": ["--offload-activations", "--offload-activations-min", "0"],
}


def measure(work: Path | None = None, timed: int = 4, rounds: int = 2) -> dict:
    work = Path(work or ROOT / "out" / "bench" / "act_offload")
    work.mkdir(parents=True, exist_ok=True)
    compiled = compile_plan(work / "pkg", MODEL, 2, hardware="cpu", schedule=SCHEDULE)
    out, package = Path(compiled["output"]), Path(compiled["package"]).name
    where = out / package / "plan.json"  # the one the package runs
    plan = json.loads(where.read_text())
    plan["recompute"] = False  # activations kept: autograd's saved tensors are parked
    write_atomic(where, json.dumps(plan, indent=1))
    steps = timed + sum(WINDOW)
    argv = ["--steps", str(steps), "--schedule", SCHEDULE, "--lr", "1e-4", "--seed", "0"]

    def runner(extra):
        return lambda tag, _: run_package(
            out, package, argv + extra, work / f"{tag}.json", actions=True
        )

    raw = run_rounds({name: runner(extra) for name, extra in CONFIGS.items()}, rounds, "offload")
    m = int(plan["micro_batches"])
    batch = m * int(plan["model"]["micro_batch"])
    steady = range(WINDOW[0], WINDOW[0] + timed)
    runs = {}
    for name, results in raw.items():
        times = [t for r in results for t in step_times(r["step_ends_s"], *WINDOW)]
        runs[name] = {
            **summarise_steps(times, batch),
            "compute_cpu_per_step_s": [_compute_cpu(r, m, steady) for r in results],
            "losses": results[0]["losses"],
            "same_losses": all(r["losses"] == raw["plain"][0]["losses"] for r in results),
            "activation_offload": results[0].get("activation_offload"),
            "other_cores": [r["other_cores"] for r in results],
        }
    base = runs["plain"]
    for stats in runs.values():
        stats["overhead"] = stats["step_s"] / base["step_s"] - 1
        stats["cpu_overhead"] = (
            min(stats["compute_cpu_per_step_s"]) / min(base["compute_cpu_per_step_s"]) - 1
        )  # each configuration's least disturbed round
    return {"model": MODEL, "schedule": SCHEDULE, "micro_batches": plan["micro_batches"],
            "timed_steps": timed, "rounds": rounds, "runs": runs}  # fmt: skip


def _compute_cpu(result: dict, micro_batches: int, steady: range) -> float:
    """CPU seconds of the forwards and backwards per steady step, every rank's."""
    per_stage = summarise(load_actions(result["action_files"]), micro_batches, steady)
    return sum(
        kinds[k]["cpu_s"] * kinds[k]["count"] / len(steady)
        for kinds in per_stage.values()
        for k in ("F", "B")
        if k in kinds
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--work", type=Path, default=None)
    p.add_argument("--timed", type=int, default=4)
    p.add_argument("--rounds", type=int, default=2)
    a = p.parse_args()
    print(json.dumps(measure(a.work, a.timed, a.rounds), indent=1))


if __name__ == "__main__":
    main()
