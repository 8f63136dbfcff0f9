"""A 3-stage plan of the GPT-2 bench model on 2 GPUs, cut by hand, with its package.

    python -m benchmarks.fidelity.handmade_plan -o out/bench/fidelity/v --schedule 1f1b   # prints JSON

GPU 0 runs stage 0 (embeddings, blocks 0-3) and stage 2 (the LM head and its loss, one
fused op); GPU 1 runs stage 1 (blocks 4-7, final norm). Activations go 0 -> 1 -> 0 and
gradients back the same way: a plan no partitioner would pick, chosen to exercise what the
simulator models beyond a chain (two stages sharing a GPU, a round trip). Costs
come from the measured profile (`--profile measured`, cached), on the threads this process
has: run it with OMP_NUM_THREADS=1 to predict 1-thread ranks. Prints what `ftpipe compile
--json` prints, in part: output, package, winner, simulated, lower_bound_s.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from ftpipe_compiler.codegen import generate_package
from ftpipe_compiler.costs.profilers import costed_graph
from ftpipe_compiler.partition import build_plan, problem_from_graph
from ftpipe_compiler.simulate import simulate, write_report

MODEL = "gpt2-bench"
GPU_OF = {0: 0, 1: 1, 2: 0}


def cut(graph, first_block_of_stage_1: int = 4) -> dict[str, int]:
    """Node -> stage by position in topological order, so the stage graph is a chain: stage
    1 from the first node of block `first_block_of_stage_1` up to the LM head, stage 2 from
    it."""
    ids = [n.id for n in graph.nodes]
    prefix = f"transformer.h.{first_block_of_stage_1}"
    start = next(i for i, n in enumerate(graph.nodes) if n.scope.startswith(prefix))
    head = min(i for i, n in enumerate(graph.nodes) if n.scope == "lm_head")
    return {nid: 0 if i < start else 1 if i < head else 2 for i, nid in enumerate(ids)}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-o", "--output", required=True)
    ap.add_argument("--schedule", default="1f1b")
    ap.add_argument("--hardware", default="cpu")
    args = ap.parse_args(argv)
    out = Path(args.output)
    spec, task, traced, graph = costed_graph(MODEL, hardware=args.hardware, profile="measured")
    problem = problem_from_graph(graph, 2, args.hardware, args.schedule, None, None, 0)
    plan = build_plan(problem, cut(graph), GPU_OF, "by-hand")
    if sorted((s.id, s.gpu) for s in plan.stages) != sorted(GPU_OF.items()):
        raise SystemExit(f"unexpected stages: {[(s.id, s.gpu) for s in plan.stages]}")
    sim = simulate(plan)
    command = "python " + " ".join(sys.argv)
    plan = plan.with_(simulated=sim.summary(), command=command)
    out.mkdir(parents=True, exist_ok=True)
    plan.save(out / "plan.json")
    write_report(out / "report.html", plan, sim, command)
    package = generate_package(traced, graph, plan, spec, out, command, force=True)
    summary = {
        "output": str(out),
        "package": str(package),
        "winner": plan.partitioner,
        "simulated": sim.summary(),
        "lower_bound_s": problem.lower_bound(),
    }
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
