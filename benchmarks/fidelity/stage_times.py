"""Each stage of a compiled plan timed as one block, on this process's threads; prints JSON.

    OMP_NUM_THREADS=1 python -m benchmarks.fidelity.stage_times out/plan.json   # {"0": {"fwd_s": ...}}

The plan's op-level profile times every op apart; this times what each stage runs as a whole
(`ftpipe_compiler.costs.measured.measure_stages`), alone, before any run: the fidelity
section simulates the plan with these stage times beside the op profile's sums.
"""

from __future__ import annotations

import json
import sys

from ftpipe_compiler.costs.measured import measure_stages
from ftpipe_compiler.costs.profilers import costed_graph
from ftpipe_compiler.plan import Plan


def stage_times(plan: Plan, repeats: int = 3) -> dict:
    m = plan.model
    spec, _, traced, _ = costed_graph(
        m["spec"], m.get("task"), micro_batch=m.get("micro_batch"), seq_len=m.get("seq_len")
    )
    stages = [(s.id, (*s.nodes, *s.copies)) for s in sorted(plan.stages, key=lambda s: s.id)]
    timed = measure_stages(traced, spec, stages, repeats=repeats)
    keys = ("fwd_s", "recompute_s", "bwd_s", "wgrad_s")
    return {str(s): {k: getattr(t, k) for k in keys} for s, t in timed.items()}


if __name__ == "__main__":
    print(json.dumps(stage_times(Plan.load(sys.argv[1]))))
