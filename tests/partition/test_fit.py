"""Partitioners fit the plan's full memory count, not only `Problem.memory`'s estimate.

The estimate leaves room beside the stages for two neighbours' receive buffers of the largest
activation, and nothing for a weight read from another GPU (a tied embedding: its copy and
gradient sum on the reader's GPU). A cut filling the estimate may then be over as the plan
counts it (`Plan.gpu_memory`); `partition/fit.py` makes the partitioners cut again within
the room the plan left.
"""

from __future__ import annotations

from dataclasses import replace

from partition_helpers import tied_chain

from ftpipe_compiler.errors import InfeasibleError
from ftpipe_compiler.partition import PARTITIONERS, Problem, fit

MB = 2**20


def _plans(problem: Problem) -> dict[str, object]:
    out = {}
    for name, fn in PARTITIONERS.items():
        try:
            out[name] = fn(problem)
        except InfeasibleError:
            out[name] = None
    return out


def test_partitioners_cut_again_where_the_plan_counts_a_gpu_over(monkeypatch):
    loose = tied_chain()
    beside = loose.capacity - loose.memory  # what the estimate keeps beside the stages
    fixed = set()
    for extra in range(40, 100, 6):  # the stages' room, from too tight for any cut to loose
        problem = replace(loose, memory_bytes=beside + extra * MB)
        with monkeypatch.context() as m:
            m.setattr(fit, "ROUNDS", 0)  # each partitioner's cut as the estimate alone allows
            before = _plans(problem)
        after = _plans(problem)
        for name, plan in after.items():
            was = before[name]
            if was is not None and was.feasible:
                assert plan is not None and plan.feasible, (name, extra)  # nothing lost
            if plan is not None and plan.feasible:
                plan.validate()  # the full check `run_partitioner` applies
                assert plan.max_memory_bytes <= problem.capacity
                if was is not None and not was.feasible:
                    fixed.add(name)
        if before["mixed"] is not None and not before["mixed"].feasible:
            # no candidate of mixed fitted by the estimate alone: refitted, one does
            assert after["mixed"].feasible, extra
    # the estimate was too low, and cutting again within the plan's count found plans that fit
    assert {"mixed", "pipedream", "acyclic", "metis"} <= fixed
