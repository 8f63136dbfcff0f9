"""BENCHMARKS.md section 3 as Markdown, from what `bench_runtime.measure()` returned.

    text = markdown(data)

Every sentence that states a result is computed from `data`: a rerun that measures
something else says something else.
"""

from __future__ import annotations

from benchmarks.harness.stats import fmt_rate, fmt_ratio
from benchmarks.runtime.vs_pipelining import SCHEDULES, ms, rate, section_a

_ACTION_CELLS = (("F", "compute_s"), ("F", "wait_s"), ("B", "compute_s"), ("B", "wait_s"),
                 ("S", "compute_s"))  # fmt: skip


def _work(stage: dict, last: bool) -> float:
    """Profiled seconds per micro-batch under 1F1B (the last stage does not recompute)."""
    return stage["fwd_s"] + stage["bwd_s"] + (0.0 if last else stage["recompute_s"])


def _stage_rows(name: str, plan: dict, actions: dict | None) -> list[str]:
    """One row per stage: what the profile says, what the 1F1B run's actions took (ms)."""
    stages = sorted(plan["stages"], key=lambda s: s["stage"])
    rows = []
    for s in stages:
        what = f"blocks {s['blocks'][0]}-{s['blocks'][-1]}" if s["blocks"] else "no blocks"
        a = (actions or {}).get(str(s["stage"]), {})
        cells = [ms(a[k][key]) if k in a else "-" for k, key in _ACTION_CELLS]
        rows.append(
            f"| {name} | {s['stage']} | {s['gpu']} | {s['nodes']} nodes, {what} | "
            f"{ms(_work(s, s is stages[-1]))} | " + " | ".join(cells) + " |"
        )
    return rows


def _section_b(d: dict) -> list[str]:
    runs, even, best = d["runs"], d["plans"]["even"], d["plans"]["ftpipe"]
    lines = [
        "### 3b. The compiled plan vs the even split a pipelining user writes",
        "",
        "`ftpipe compile --model gpt2-bench --gpus 2 --hardware cpu --profile measured "
        "--schedule 1f1b` (all partitioners, one-thread measured profile). Both plans run in "
        "ftpipe's runtime under the same schedule, so the ratio is the partition's alone; the "
        "last row puts the plan under FTPipe's asynchronous schedule against what a pipelining "
        "user runs (the even split, pipelining's 1F1B).",
        "",
        "| schedule | even split | compiled plan | plan / even | simulated plan / even |",
        "|---|---:|---:|---:|---:|",
    ]
    sim = best["competitors"]
    sim_ratio = sim[even["partitioner"]] / sim[best["partitioner"]]
    for s, label in SCHEDULES.items():
        a, b = runs[f"ftpipe-even-{s}"], runs[f"ftpipe-plan-{s}"]
        sim_cell = f"{sim_ratio:.2f}" if s == "1f1b" else ""
        lines.append(
            f"| {label} | {fmt_rate(a)} | {fmt_rate(b)} | {fmt_ratio(b, a)} | {sim_cell} |"
        )
    asy, ref = runs["ftpipe-plan-ftpipe"], runs["pipelining-1f1b"]
    lines += [
        f"| plan + FTPipe async vs pipelining 1F1B | {fmt_rate(ref)} | {fmt_rate(asy)} | "
        f"{fmt_ratio(asy, ref)} | |",
        "",
        "Per stage, in ms per micro-batch: the profile's forward + backward (+ recompute where "
        "1F1B recomputes), and what the 1F1B runs' actions took, waits for messages apart "
        "(step: the optimizer-step action, per step):",
        "",
        "| plan | stage | rank | holds | profile | F | F wait | B | B wait | step |",
        "|---|---:|---:|---|---:|---:|---:|---:|---:|---:|",
        *_stage_rows("even split", even, runs["ftpipe-even-1f1b"].get("actions")),
        *_stage_rows("compiled", best, runs["ftpipe-plan-1f1b"].get("actions")),
        "",
    ]
    last = max(best["stages"], key=lambda s: s["stage"])
    total = sum(s["fwd_s"] + s["bwd_s"] for s in best["stages"])
    even_max = max(_work(s, s["stage"] == len(even["stages"]) - 1) for s in even["stages"])
    head = _work(last, True)
    measured = rate(runs, "ftpipe-plan-1f1b") / rate(runs, "ftpipe-even-1f1b")
    lines += [
        f"The compiled plan puts the LM head and the loss alone on one stage: {ms(head)} ms "
        f"of the model's {ms(total)} ms per micro-batch ({head / total:.0%}), one matrix "
        "product over the 50,257-token vocabulary that no pipeline split can cut. No 2-stage "
        f"plan has a slowest stage under {ms(head)} ms, so against the even split's "
        f"{ms(even_max)} ms the partition can gain at most {even_max / head:.2f}x by the "
        f"profile ({sim_ratio:.2f}x simulated, with the transfers); measured under 1F1B: "
        f"{measured:.2f}x. " + _best_against_pipelining(runs, even_max / head),
        "",
    ]
    return lines


def _best_against_pipelining(runs: dict, cap: float) -> str:
    """The compiled plan under its fastest schedule against pipelining's fastest run on the
    even split, either allocator (issue 18's 1.2x), and what caps it."""
    ours = max((n for n in runs if n.startswith("ftpipe-plan-")), key=lambda n: rate(runs, n))
    theirs = max((n for n in runs if n.startswith("pipelining-")), key=lambda n: rate(runs, n))
    ratio = rate(runs, ours) / rate(runs, theirs)
    verdict = "at least" if ratio >= 1.2 else "short of"
    return (
        f"The plan under its fastest schedule ({ours}) against pipelining's fastest run on the "
        f"even split ({theirs}): {ratio:.3f}x, {verdict} the 1.2x aimed for; the LM head caps "
        f"any 2-stage split at {cap:.2f}x by the profile (dividing it would take tensor "
        "parallelism)."
    )


def _section_c(d: dict) -> list[str]:
    runs = d["runs"]
    single = runs["single"]
    best = max((k for k in runs if k != "single"), key=lambda k: rate(runs, k))
    lines = [
        "### 3c. Against the unpartitioned model in one process",
        "",
        "| run | samples/s | / single process |",
        "|---|---:|---:|",
        f"| single process, 2 threads, batch 8 at once | {fmt_rate(single)} | 1.00 |",
    ]
    for k in ("ftpipe-even-1f1b", "pipelining-1f1b", "ftpipe-plan-1f1b", "ftpipe-plan-ftpipe"):
        lines.append(
            f"| {k} (2 ranks x 1 thread) | {fmt_rate(runs[k])} | {fmt_ratio(runs[k], single)} |"
        )
    share = rate(runs, best) / rate(runs, "single")
    why = (
        "its schedule keeps both ranks busy with whole micro-batches, while one process "
        "shares each operator between its two threads"
        if share >= 1.0
        else "on two cores a pipeline adds a fill and drain bubble, recomputation, messages "
        "through gloo and an imbalance (the LM head) that one process with two threads does "
        "not have"
    )
    lines += [
        "",
        f"The fastest pipeline ({best}) reaches {share:.0%} of one process using both cores: "
        f"{why}. A pipeline pays off when the model does not fit one device; this benchmark "
        "model fits in one.",
        "",
    ]
    return lines


def _quality(d: dict) -> str:
    """How far outside load and nondeterminism could have moved the figures."""
    loads = [(c, name) for name, r in d["runs"].items() for c in r["other_cores"] if c is not None]
    same = [name for name, r in d["runs"].items() if not r["same_losses_every_round"]]
    text = ""
    if d["rounds"] > 1:
        text = (
            "Every round repeated every loss exactly. "
            if not same
            else f"Losses differed between rounds in {', '.join(same)}. "
        )
    if loads:
        worst, where = max(loads)
        mean = sum(c for c, _ in loads) / len(loads)
        text += (
            f"Other processes on this machine used {mean:.2f} cores on average while the runs "
            f"went (at most {worst:.2f}, during {where})."
        )
    return text


def _windows(d: dict) -> str:
    """Which steps each contender's runs left untimed (older data: one window for all)."""
    windows = d.get("windows") or {"every run": (d["warmup_steps"], d["cooldown_steps"])}
    return "; ".join(f"{who} after {a} warm-up step(s), {b} untimed at the end"
                     for who, (a, b) in windows.items())  # fmt: skip


def markdown(d: dict) -> str:
    lines = [
        "## 3. Runtime: the generated package on 2 CPU processes",
        "",
        f"`{d['model']}`: GPT-2 with 8 blocks, d_model 256, the 50,257-token vocabulary and "
        f"tied embeddings; batch {d['batch']} of {d['seq_len']} tokens in "
        f"{d['micro_batches']} micro-batches; AdamW at a constant {d['lr']:g}, no clipping; "
        "2 ranks of one thread each (gloo), every run from the same weights on the same "
        f"micro-batches. Every configuration ran "
        + (
            "once"
            if d["rounds"] == 1
            else f"{d['rounds']} times, the rounds one after the "
            "other, every other one in the reverse order (an order effect spreads over all)"
        )
        + f"; each run timed {d['timed_steps']} steps ("
        + _windows(d)
        + "), and a figure pools the "
        f"{d['rounds'] * d['timed_steps']} timed steps of its configuration: samples/s = "
        f"batch / mean step time. One run of `python -m benchmarks` ({d.get('bench_seconds', 0):.0f} "
        "s).",
        "",
        _quality(d),
        "",
    ]
    return "\n".join(lines + section_a(d) + _section_b(d) + _section_c(d))
