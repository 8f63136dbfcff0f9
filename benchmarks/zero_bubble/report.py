"""Section `zero_bubble` as Markdown, from what `zero_bubble.bench.measure()` returned."""

from __future__ import annotations

from benchmarks.zero_bubble.bench import SIM_GPUS, fastest


def markdown(data: dict) -> str:
    lines = ["## Zero-bubble and interleaved schedules", ""]
    if data.get("runtime"):
        lines += _runtime(data["runtime"])
    if data.get("simulated"):
        lines += _simulated(data["simulated"])
    return "\n".join(lines)


def _runtime(rt: dict) -> list[str]:
    runs = rt["runs"]
    rounds = "one run" if rt["rounds"] == 1 else f"{rt['rounds']} rounds"
    lines = [
        f"### a. Runtime vs torch.distributed.pipelining ({rt['model']}, 2 CPU ranks, batch "
        f"{rt['batch']} in {rt['micro_batches']} micro-batches, {rounds} of "
        f"{rt['timed_steps']} timed steps)",
        "",
        "Same split (ftpipe's even plan for the schedule, blocks per stage and their ranks "
        "below), same weights, data and AdamW update; pipelining with PyTorch's defaults, the "
        "package with its CPU settings (huge pages, fused AdamW: section 3a gives pipelining "
        "those too). *ours / theirs*: samples/s over every timed "
        "step of every round, and (in brackets) the fastest step of each, which outside load "
        "(*other cores*: CPU others used during the runs, of 2) disturbs least; *same work*: "
        "pipelining also recomputing where ftpipe does. One run of this section.",
        "",
        "| schedule | blocks per stage (ranks) | ftpipe samples/s | pipelining samples/s "
        "| ours / theirs | pipelining + recompute | ours / theirs, same work | other cores "
        "| losses equal |",
        "|---|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for s, split in rt["plans"].items():
        ours, theirs = runs[f"ftpipe-{s}"], runs[f"pipelining-{s}"]
        same = runs[f"pipelining-{s}-recompute"]
        equal = _close(ours["losses"], theirs["losses"])
        load = [c for r in (ours, theirs, same) for c in r["other_cores"] if c is not None]
        lines.append(
            f"| {s} | {split['blocks']} ({','.join(map(str, split['gpus']))}) | "
            f"{ours['samples_per_s']:.2f} | {theirs['samples_per_s']:.2f} | "
            f"{_ratio(ours, theirs)} | {same['samples_per_s']:.2f} | {_ratio(ours, same)} | "
            + (f"{min(load):.1f}-{max(load):.1f}" if load else "-")
            + f" | {'yes' if equal else 'no'} (rel 1e-4) |"
        )
    return lines + [""]


def _simulated(sim: dict) -> list[str]:
    lines = [
        f"### b. Simulated on {SIM_GPUS} GPUs: partition x schedule vs the best sequential "
        "partition under 1F1B",
        "",
        "Every partitioner under every schedule (nothing pruned but by the lower bound), "
        "simulated; *best* may be an asynchronous schedule (stale weights: ftpipe, 2bw, "
        "wpipe), *best sync* trains exactly like one process.",
        "",
        "| model | GPUs | 1F1B, best sequential | s/step | best sync | s/step | speedup "
        "| best | s/step | speedup |",
        "|---|---|---|---:|---|---:|---:|---|---:|---:|",
    ]
    for c in sim["cases"]:
        base, sync, best = c["baseline"], c["best_sync"], c["best"]
        lines.append(
            f"| {c['model']} ({c['task']}, {c['micro_batches']} x {c['micro_batch']}) | "
            f"{c['gpus']} x {c['hardware']} | "
            + (
                f"{base['partitioner']} | {base['simulated_step_time_s']:.3f}"
                if base
                else "none fits | -"
            )
            + f" | {_vs(sync, base)} | {_vs(best, base)} |"
        )
    return (
        lines
        + ["", "Per schedule, its fastest plan (s/step simulated, bubble, peak GiB):", ""]
        + _per_schedule(sim)
    )


def _per_schedule(sim: dict) -> list[str]:
    names = list(dict.fromkeys(r["schedule"] for r in sim["cases"][0]["matrix"]))
    lines = ["| model | " + " | ".join(names) + " |", "|---|" + "---:|" * len(names)]
    for c in sim["cases"]:
        row = []
        for n in names:
            r = fastest([x for x in c["matrix"] if x["schedule"] == n and x["status"] == "ok"])
            row.append(
                "does not fit" if r is None else
                f"{r['simulated_step_time_s']:.3f} ({r['partitioner']}, "
                f"{r['bubble_fraction']:.0%}, {r['max_memory_bytes'] / 2**30:.1f})"
            )  # fmt: skip
        lines.append(f"| {c['model']} | " + " | ".join(row) + " |")
    return lines + [""]


def _close(a: list[float], b: list[float]) -> bool:
    """Losses within rel 1e-4 (the runtimes sum micro-batch losses in another order)."""
    return len(a) == len(b) and all(abs(x - y) <= 1e-4 * abs(y) for x, y in zip(a, b))


def _ratio(ours: dict, theirs: dict) -> str:
    mean = ours["samples_per_s"] / theirs["samples_per_s"]
    return f"{mean:.2f} ({theirs['step_min_s'] / ours['step_min_s']:.2f})"


def _vs(r: dict | None, base: dict | None) -> str:
    if r is None:
        return "none fits | - | -"
    speedup = base["simulated_step_time_s"] / r["simulated_step_time_s"] if base else None
    return f"{r['partitioner']} / {r['schedule']} | {r['simulated_step_time_s']:.3f} | " + (
        f"{speedup:.2f}x" if speedup else "-"
    )
