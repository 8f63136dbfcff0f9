"""Section `zero_bubble` of BENCHMARKS.md: zero-bubble and interleaved schedules.

    python -m benchmarks --sections zero_bubble --out /tmp/zero_bubble.md

a. Runtime, 2 CPU ranks (gloo), GPT-2 bench model: our zero-bubble and interleaved
   schedules against torch.distributed.pipelining's schedule of the same name on the same
   split (zb1p - ScheduleInterleavedZeroBubble with one stage per rank, interleaved - ScheduleInterleaved1F1B and zbv - ScheduleZBVZeroBubble
   with two stages per rank in a loop / a V). The split is ftpipe's plan for that schedule by
   the `even-layers` partitioner, cut at the same blocks for pipelining. Pipelining runs as
   its users run it (no recompute: its best) and with the recomputation ftpipe's schedules
   do (the same work). Every configuration runs once per round, as in section `runtime`.
   GPipe and 1F1B against ScheduleGPipe / Schedule1F1B on the same even split are section
   `runtime`'s (measured there, not twice: it keeps `make bench` within its time).
b. Simulated, 8 GPUs: T5-3B, GPT2-XL and Llama-3.1-8B; every partitioner under every
   schedule (`planner.matrix.search_matrix`, nothing left unsearched), the best plan overall and
   the best synchronous one against the best sequential partition (pipedream, acyclic,
   even-layers, params) under 1F1B.
"""

from __future__ import annotations

import json
import re
import sys
import time
from functools import partial
from pathlib import Path

from benchmarks.harness.launch import ROOT, compile_plan
from benchmarks.harness.set_up import prepare, take
from benchmarks.harness.stats import run_rounds
from benchmarks.runtime.bench import Bench, ungroup, write_weights
from ftpipe_compiler.costs.profilers import costed_graph
from ftpipe_compiler.partition import problem_from_graph
from ftpipe_compiler.planner.matrix import schedule_names, search_matrix

MODEL = "gpt2-bench"
WORK = ROOT / "out" / "bench" / "zero_bubble"
WEIGHTS = partial(write_weights, model=MODEL)  # every run's initial weights, in WORK
RUNTIME = ("zb1p", "interleaved", "zbv")  # pipelining has each; gpipe and 1f1b: section runtime

# (model, hardware): the paper's GPU for T5-3B and GPT2-XL; Llama-3.1-8B's fp32 weights,
# gradients and Adam state (128 GB) need larger ones.
SIM_CASES = [("t5-3b", "rtx2080ti"), ("gpt2-xl", "rtx2080ti"), ("llama-3.1-8b", "a100-40gb")]
SIM_GPUS = 8
SEQUENTIAL = ("pipedream", "acyclic", "even-layers", "params")
# One round of 3 timed steps (6 steps a run): the runtime section's two rounds, or the 5 timed
# steps this ran until make bench took 31 minutes, would cost 1-4 minutes more.
TIMED, ROUNDS = 3, 1


def stage_blocks(plan: dict) -> list[int]:
    """Transformer blocks per stage in chain order, checked contiguous and whole."""
    blocks: dict[int, set[int]] = {s["id"]: set() for s in plan["stages"]}
    for s in plan["stages"]:
        for name in s["params"]:
            hit = re.match(r"transformer\.h\.(\d+)\.", name)
            if hit:
                blocks[s["id"]].add(int(hit.group(1)))
    order = sorted(blocks)
    seen = [b for i in order for b in sorted(blocks[i])]
    if seen != list(range(len(seen))):
        raise ValueError(f"not a split at whole blocks in stage order: {blocks}")
    return [len(blocks[i]) for i in order]


def runtime(work: Path | None = None, rounds: int = ROUNDS) -> dict:
    work = Path(work or WORK)
    work.mkdir(parents=True, exist_ok=True)
    compiled = {
        s: compile_plan(
            work / f"plan-{s}",
            MODEL,
            2,
            hardware="cpu",
            profile="measured",
            schedule=s,
            partitioners="even-layers",
        )  # fmt: skip
        for s in RUNTIME
    }
    plans = {
        s: json.loads((Path(c["output"]) / "plan.json").read_text()) for s, c in compiled.items()
    }
    first = plans[RUNTIME[0]]
    bench = Bench(work, int(first["micro_batches"]), int(first["model"]["micro_batch"]), TIMED)
    take(work, WEIGHTS)  # bench.weights
    todo, splits, piped = {}, {}, {}
    for s, plan in plans.items():
        blocks = ",".join(map(str, stage_blocks(plan)))
        splits[s] = {"blocks": blocks, "gpus": [st["gpu"] for st in plan["stages"]]}
        path = Path(compiled[s]["output"]) / "plan.json"
        todo[f"ftpipe-{s}"] = lambda n, _, s=s: bench.ftpipe(compiled[s], s, n)
        for rec in (False, True):
            piped[f"pipelining-{s}" + ("-recompute" if rec else "")] = (path, blocks, s, rec)
    todo["pipelining"] = lambda n, r: bench.pipelining(piped, n, reverse=r % 2 == 1)
    raw = ungroup(run_rounds(todo, rounds, "zero_bubble"))
    runs = {name: bench.merge(results) for name, results in raw.items()}
    for name, stats in runs.items():
        print(f"  {name}: {stats['samples_per_s']:.2f} samples/s", file=sys.stderr)
    return {"model": MODEL, "batch": bench.batch, "micro_batches": bench.micro_batches,
            "rounds": rounds, "timed_steps": TIMED, "plans": splits, "runs": runs}  # fmt: skip


def fastest(rows: list[dict]) -> dict | None:
    return min(rows, key=lambda r: r["simulated_step_time_s"], default=None)


def simulated() -> dict:
    cases = []
    for model, hardware in SIM_CASES:
        t0 = time.perf_counter()
        _, task, _, graph = costed_graph(model, hardware=hardware)
        problem = problem_from_graph(
            graph, SIM_GPUS, hardware, "1f1b", task.optimizer, task.micro_batches, 0
        )
        names = schedule_names("auto")
        winner, matrix = search_matrix(problem, names, width=len(names), progress=False)
        rows = [c.to_json() for c in matrix]
        ok = [r for r in rows if r["status"] == "ok"]
        cases.append(
            {
                "model": model,
                "hardware": hardware,
                "gpus": SIM_GPUS,
                "task": task.name,
                "micro_batches": problem.micro_batches,
                "micro_batch": graph.meta.get("micro_batch"),
                "best": fastest(ok),
                "best_sync": fastest([r for r in ok if r["update"] == "sync"]),
                "baseline": fastest(
                    [r for r in ok if r["schedule"] == "1f1b" and r["partitioner"] in SEQUENTIAL]
                ),
                "matrix": rows,
                "seconds": time.perf_counter() - t0,
            }
        )
        print(f"  simulated {model}: {cases[-1]['seconds']:.0f} s", file=sys.stderr)
    return {"cases": cases}


PARTS = {  # (run, alone): the weights written beside the simulations, the runs timed alone
    "simulated": (simulated, False),
    "weights": (partial(prepare, WORK, WEIGHTS), False),
    "runtime": (runtime, True),
}


def combine(parts: dict) -> dict:
    return {"simulated": parts["simulated"], "runtime": parts["runtime"]}


def measure() -> dict:
    return {"simulated": simulated(), "runtime": runtime()}


if __name__ == "__main__":
    part = sys.argv[1] if len(sys.argv) > 1 else "simulated"
    print(json.dumps({"simulated": simulated, "runtime": runtime}[part](), indent=1))
