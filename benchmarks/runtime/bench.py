"""BENCHMARKS.md section 3: the generated package at run time, on 2 CPU processes (gloo).

    data = measure()            # ~4 min on 2 cores: compiles 2 plans, 10 configurations twice
    print(markdown(data))

GPT-2 bench model (8 blocks, d_model 256, 50,257-token vocabulary, tied embeddings), batch
8 of 128 tokens in 4 micro-batches, AdamW at a constant 1e-4, no clipping, every contender
starting from one weights file and reading the same micro-batches, one thread per rank:

  a. the package vs torch.distributed.pipelining on the same 4 + 4 block split, under GPipe
     and 1F1B: pipelining with PyTorch's defaults, and tuned as the package tunes itself on
     a CPU (huge pages for large tensors, `ftpipe_runtime.job.cpu_allocator`; fused AdamW);
  b. ftpipe's compiled plan vs that even split, both in ftpipe's runtime, same schedule;
  c. the unpartitioned model in one process on both cores.

Every configuration runs once per round, the rounds one after the other, the second in the
reverse order of the first (pipelining's configurations too, which share one launch): a
disturbance from outside, or an order effect (the first configuration of a launch ran up to
25 % faster than the later ones), spreads over all configurations instead of favouring one;
each run says how much CPU others used meanwhile. Each run times TIMED steps, every contender
the same ones (WINDOWS): after two warm-up steps (the package's second step and pipelining's
are still 10-40 % slower than later ones); an asynchronous schedule's run trains one more,
untimed (its last step overlaps nothing), a flushed one's last step is like the others.
"""

from __future__ import annotations

import json
import re
import sys
from functools import partial
from pathlib import Path

import torch
from ftpipe_runtime.atomic import atomic_open
from ftpipe_runtime.job.cpu_allocator import VARIABLE
from ftpipe_runtime.schedules import get_schedule

from benchmarks.harness.actions import load_actions, summarise
from benchmarks.harness.launch import ROOT, compile_plan, flags, run_child, run_package, torchrun
from benchmarks.harness.reference import build_model
from benchmarks.harness.set_up import prepare, take, timed_only
from benchmarks.harness.stats import run_rounds, step_times, summarise_steps
from benchmarks.runtime.report import markdown  # noqa: F401 - the section's renderer

MODEL = "gpt2-bench"
WORK = ROOT / "out" / "bench" / "runtime"
# Steady steps per run; rounds in alternating order. 2 x 2 timed steps a configuration (3 x 2
# until make bench ran 31 minutes, against its ~20).
TIMED, ROUNDS = 2, 2
WARMUP = 2  # untimed first steps of every run
# (untimed first, untimed last) steps: pipelining's schedules and the single process flush
WINDOWS = {"ftpipe": (WARMUP, 0), "ftpipe, asynchronous": (WARMUP, 1), "pipelining": (WARMUP, 0),
           "single": (WARMUP, 0)}  # fmt: skip
LR, SEED = 1e-4, 0
TRAINING = ["--lr", str(LR), "--decay", "constant", "--clip", "0", "--seed", str(SEED)]


def ungroup(raw: dict[str, list[dict]]) -> dict[str, list[dict]]:
    """`run_rounds`' results with each launch of several configurations (`Bench.pipelining`)
    split into one result per configuration, each with the launch's `other_cores`."""
    out: dict[str, list[dict]] = {}
    for name, results in raw.items():
        for r in results:
            group = r.get("group", {name: r})
            for sub, result in group.items():
                out.setdefault(sub, []).append({**result, "other_cores": r["other_cores"]})
    return out


def blocks_on_first_stage(plan: dict) -> int:
    """Transformer blocks of stage 0 of a contiguous 2-stage split (checked contiguous)."""
    blocks = {}
    for s in plan["stages"]:
        for name in s["params"]:
            hit = re.match(r"transformer\.h\.(\d+)\.", name)
            if hit:
                blocks.setdefault(s["id"], set()).add(int(hit.group(1)))
    first = blocks.get(0, set())
    if first != set(range(len(first))) or blocks.get(1, set()) & first:
        raise ValueError(f"not a contiguous split: stage blocks {blocks}")
    return len(first)


def stage_costs(plan: dict) -> list[dict]:
    """What the profile says each stage costs per micro-batch (for the write-up)."""
    return [
        {
            "stage": s["id"],
            "gpu": s["gpu"],
            "nodes": len(s["nodes"]),
            "blocks": sorted({int(h) for p in s["params"] for h in re.findall(r"\.h\.(\d+)\.", p)}),
            "fwd_s": s["fwd_s"],
            "bwd_s": s["bwd_s"],
            "recompute_s": s["recompute_s"],
        }
        for s in plan["stages"]
    ]


class Bench:
    """The runs of one measurement: one work folder, one weights file, one step count. Each
    run returns its losses, when its steps ended, and the CPU others used meanwhile."""

    def __init__(self, work: Path, micro_batches: int, micro_batch: int, timed: int):
        self.work, self.micro_batches = work, micro_batches
        self.batch = micro_batches * micro_batch
        self.timed = range(WARMUP, WARMUP + timed)  # every run's timed steps
        self.weights = work / "weights.pt"

    def steps(self, window: tuple[int, int]) -> int:
        return window[0] + len(self.timed) + window[1]

    def ftpipe(self, compiled: dict, schedule: str, name: str) -> dict:
        """A run of the package, with how long its actions took (`bench_actions`)."""
        window = WINDOWS["ftpipe" if get_schedule(schedule).synchronous else "ftpipe, asynchronous"]
        argv = ["--steps", str(self.steps(window)), "--schedule", schedule]
        argv += ["--init", str(self.weights)]
        out, package = Path(compiled["output"]), Path(compiled["package"]).name
        result = run_package(
            out, package, argv + TRAINING, self.work / f"{name}.json", actions=True
        )
        if "action_files" in result:
            rows = load_actions(result["action_files"])
            result["actions"] = summarise(rows, self.micro_batches, self.timed)
        return {**result, "window": window}

    def pipelining(
        self, configs: dict, tag: str, reverse: bool = False, tuned: bool = False
    ) -> dict:
        """Every configuration, name -> (plan, blocks, schedule, recompute), trained in one
        launch one after the other (`reverse`: in the reverse order), with PyTorch's
        defaults or (`tuned`) the package's CPU settings: huge pages, fused AdamW; returns
        {"group": name -> its result} (`ungroup`)."""
        if reverse:
            configs = dict(reversed(configs.items()))
        runs = [
            {"plan": str(plan), "blocks": blocks, "schedule": schedule, "recompute": recompute,
             "fused": tuned, "result": str(self.work / f"{name}.{tag}.json")}
            for name, (plan, blocks, schedule, recompute) in configs.items()
        ]  # fmt: skip
        listed = self.work / f"pipelining.{tag}.runs.json"
        with atomic_open(listed, "w") as f:
            json.dump(runs, f)
        args = ["-m", "benchmarks.harness.pipelining_worker", "--runs", listed]
        steps = self.steps(WINDOWS["pipelining"])
        args += flags(weights=self.weights, steps=steps, lr=LR, seed=SEED)
        torchrun(args, listed.with_suffix(".log"), extra={VARIABLE: "1" if tuned else "0"})
        window = {"window": WINDOWS["pipelining"]}
        group = {n: {**json.loads(Path(r["result"]).read_text()), **window}
                 for n, r in zip(configs, runs)}  # fmt: skip
        if any(g["huge_pages"] != tuned for g in group.values()):
            raise RuntimeError(f"pipelining ran with huge pages {not tuned}, not as asked")
        return {"group": group}

    def single(self, plan: Path, name: str) -> dict:
        result, steps = self.work / f"{name}.json", self.steps(WINDOWS["single"])
        cmd = [sys.executable, "-m", "benchmarks.harness.reference"] + flags(
            plan=plan, weights=self.weights, steps=steps, lr=LR, seed=SEED, threads=2,
            result=result,
        )  # fmt: skip
        run_child(cmd, result.with_suffix(".log"), threads=2, extra={VARIABLE: "1"})
        return {**json.loads(result.read_text()), "window": WINDOWS["single"]}

    def merge(self, rounds: list[dict]) -> dict:
        """One configuration's rounds: every timed step, the first round's losses."""
        times = [t for r in rounds for t in step_times(r["step_ends_s"], *r["window"])]
        return {
            **summarise_steps(times, self.batch),
            "actions": rounds[0].get("actions"),  # the first round's, per stage (ftpipe only)
            "losses": rounds[0]["losses"],
            "same_losses_every_round": all(r["losses"] == rounds[0]["losses"] for r in rounds),
            "other_cores": [r["other_cores"] for r in rounds],
        }


def write_weights(work: Path, model: str = MODEL) -> dict:
    """Every run's initial weights (SEED's), in work/weights.pt (`Bench.weights`)."""
    with atomic_open(work / "weights.pt", "wb") as f:
        torch.save(build_model(model, SEED).state_dict(), f)
    return {"weights": str(work / "weights.pt")}


def measure(work: Path | None = None, timed: int = TIMED, rounds: int = ROUNDS) -> dict:
    work = Path(work or WORK)
    work.mkdir(parents=True, exist_ok=True)
    common = dict(hardware="cpu", profile="measured", schedule="1f1b")
    even = compile_plan(work / "even", MODEL, 2, partitioners="even-layers", **common)
    best = compile_plan(work / "ftpipe", MODEL, 2, **common)
    even_path = work / "even" / "plan.json"
    even_plan = json.loads(even_path.read_text())
    best_plan = json.loads((work / "ftpipe" / "plan.json").read_text())
    blocks = blocks_on_first_stage(even_plan)
    m, size = int(even_plan["micro_batches"]), int(even_plan["model"]["micro_batch"])
    bench = Bench(work, m, size, timed)
    take(work, write_weights)  # bench.weights

    todo = _configurations(bench, even, best, even_path, blocks)
    raw = ungroup(run_rounds(todo, rounds, "runtime"))
    runs = {name: bench.merge(results) for name, results in raw.items()}
    for name, stats in runs.items():
        print(f"  {name}: {stats['samples_per_s']:.2f} samples/s", file=sys.stderr)
    return {
        "model": MODEL,
        "batch": bench.batch,
        "micro_batches": m,
        "seq_len": int(even_plan["model"]["inputs"]["input_ids"][0][1]),
        "timed_steps": timed,
        "windows": WINDOWS,
        "rounds": rounds,
        "lr": LR,
        "even_blocks": blocks,
        "plans": _plans(even, even_plan, best, best_plan),
        "runs": runs,
    }


# (run, alone): the weights written beside other compute-only parts, the runs timed alone
PARTS = {"weights": (partial(prepare, WORK, write_weights), False), "": (measure, True)}
combine = timed_only


def _configurations(bench: Bench, even: dict, best: dict, even_path: Path, blocks: int) -> dict:
    """name -> a run of it: the package on the even split and on its plan, pipelining on
    the even split (PyTorch's defaults, and tuned as the package is), the model in one
    process (on huge pages: at its best)."""
    piped = {f"pipelining-{s}": (even_path, blocks, s, False) for s in ("gpipe", "1f1b")}
    tuned = {f"{name}-tuned": config for name, config in piped.items()}
    return {
        "ftpipe-even-gpipe": lambda n, _: bench.ftpipe(even, "gpipe", n),
        "ftpipe-even-1f1b": lambda n, _: bench.ftpipe(even, "1f1b", n),
        "pipelining": lambda n, r: bench.pipelining(piped, n, reverse=r % 2 == 1),
        "pipelining-tuned": lambda n, r: bench.pipelining(tuned, n, reverse=r % 2 == 1, tuned=True),
        "ftpipe-plan-gpipe": lambda n, _: bench.ftpipe(best, "gpipe", n),
        "ftpipe-plan-1f1b": lambda n, _: bench.ftpipe(best, "1f1b", n),
        "ftpipe-plan-ftpipe": lambda n, _: bench.ftpipe(best, "ftpipe", n),
        "single": lambda n, _: bench.single(even_path, n),
    }


def _plans(even: dict, even_plan: dict, best: dict, best_plan: dict) -> dict:
    """The two plans for the write-up: stage costs, the even split's transfers (a transfer
    of a parameter is a tied weight), simulated step times, the plan's competitors."""
    params = {p["name"] for p in even_plan["params"]}
    return {
        "even": {
            "partitioner": even["winner"],
            "stages": stage_costs(even_plan),
            "transfers": [
                {"tensor": t["tensor"], "bytes": t["bytes"], "weight": t["tensor"] in params}
                for t in even_plan["transfers"]
            ],
            "simulated_step_s": even["simulated"]["step_time_s"],
        },
        "ftpipe": {
            "partitioner": best["winner"],
            "stages": stage_costs(best_plan),
            "simulated_step_s": best["simulated"]["step_time_s"],
            "lower_bound_s": best["lower_bound_s"],
            "competitors": {r["partitioner"]: r["simulated_step_time_s"] for r in best["results"]},
        },
    }


if __name__ == "__main__":
    print(markdown(measure()))
