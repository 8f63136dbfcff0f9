"""The tables `partition` and `compile` print: one row per competitor, simulated or not."""

from __future__ import annotations

from ..partition import Result
from ..units import duration, rate, size

__all__ = ["matrix_table", "partition_table"]


def partition_table(results: list[Result], lower_bound: float) -> str:
    head = (
        f"{'partitioner':<11} {'period':>9} {'speedup':>8} {'stages':>6} {'max mem':>9} "
        f"{'sent':>9} {'search':>8}  feasible"
    )
    rows = [head, "-" * len(head)]
    for r in results:
        d = r.to_json()
        if r.plan is None:
            rows.append(
                f"{r.partitioner:<11} {'-':>9} {'-':>8} {'-':>6} {'-':>9} {'-':>9} "
                f"{duration(r.search_seconds):>8}  no: {r.error}"
            )
            continue
        rows.append(
            f"{r.partitioner:<11} {duration(d['period_s']):>9} {d['expected_speedup']:>8.2f} "
            f"{d['stages']:>6} {size(d['max_memory_bytes']):>9} {size(d['comm_bytes']):>9} "
            f"{duration(r.search_seconds):>8}  " + ("yes" if r.feasible else f"no: {r.error}")
        )
    rows.append(f"{'lower bound':<11} {duration(lower_bound):>9}")
    return "\n".join(rows)


def matrix_table(rows: list[dict]) -> str:
    """The partitioner x schedule cells that gave a plan, with simulated figures; the others
    (and why) are in the report and --json."""
    head = (
        f"{'schedule':<12} {'update':<6} {'partitioner':<11} {'step':>8} {'samples/s':>10} "
        f"{'bubble':>6} {'max mem':>9} {'search':>8}  fits"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        if r["simulated_step_time_s"] is None:
            continue
        lines.append(
            f"{r['schedule']:<12} {r['update']:<6} {r['partitioner']:<11} "
            f"{duration(r['simulated_step_time_s']):>8} {rate(r['simulated_samples_per_s']):>10} "
            f"{r['bubble_fraction']:>6.1%} {size(r['max_memory_bytes']):>9} "
            f"{duration(r['search_seconds']):>8}  "
            + ("yes" if r["status"] == "ok" else f"no: {r['note']}")
        )
    others = [r for r in rows if r["simulated_step_time_s"] is None]
    if others:
        counts = {}
        for r in others:
            counts[r["status"]] = counts.get(r["status"], 0) + 1
        what = ", ".join(f"{n} {k}" for k, n in counts.items())
        lines.append(f"{len(others)} more cells without a plan ({what}): see report.html")
    return "\n".join(lines)
