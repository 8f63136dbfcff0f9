"""The tables `partition` and `compile` print: one row per competitor, simulated or not."""

from __future__ import annotations

from ..partition import Result
from ..units import mib

__all__ = ["matrix_table", "partition_table"]


def partition_table(results: list[Result], lower_bound: float) -> str:
    head = (
        f"{'partitioner':<11} {'period ms':>10} {'speedup':>8} {'stages':>6} {'max GiB':>8} "
        f"{'comm MiB':>9} {'search s':>8}  feasible"
    )
    rows = [head, "-" * len(head)]
    for r in results:
        d = r.to_json()
        if r.plan is None:
            rows.append(
                f"{r.partitioner:<11} {'-':>10} {'-':>8} {'-':>6} {'-':>8} {'-':>9} "
                f"{r.search_seconds:>8.2f}  no: {r.error}"
            )
            continue
        rows.append(
            f"{r.partitioner:<11} {d['period_s'] * 1e3:>10.2f} {d['expected_speedup']:>8.2f} {d['stages']:>6} "
            f"{d['max_memory_bytes'] / 2**30:>8.2f} {mib(d['comm_bytes']):>9.1f} {r.search_seconds:>8.2f}  "
            + ("yes" if r.feasible else f"no: {r.error}")
        )
    rows.append(f"{'lower bound':<11} {lower_bound * 1e3:>10.2f}")
    return "\n".join(rows)


def matrix_table(rows: list[dict]) -> str:
    """The partitioner x schedule cells that gave a plan, with simulated figures; the others
    (and why) are in the report and --json."""
    head = (
        f"{'schedule':<12} {'update':<6} {'partitioner':<11} {'s/step':>9} {'samples/s':>10} "
        f"{'bubble':>6} {'max GiB':>7} {'search s':>8}  fits"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        if r["simulated_step_time_s"] is None:
            continue
        lines.append(
            f"{r['schedule']:<12} {r['update']:<6} {r['partitioner']:<11} "
            f"{r['simulated_step_time_s']:>9.4g} {r['simulated_samples_per_s']:>10.2f} "
            f"{r['bubble_fraction']:>6.1%} {r['max_memory_bytes'] / 2**30:>7.2f} "
            f"{r['search_seconds']:>8.2f}  "
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
