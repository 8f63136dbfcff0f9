"""BENCHMARKS.md section 4 as Markdown, from what `bench_fidelity.measure()` returned.

    text = markdown(data)

The explanation of each gap is computed from the run's own action timings: per stage, the
profiled forward / backward against what the actions took in the run (waits excluded), and
the optimizer-step actions, which the simulator counts as free.
"""

from __future__ import annotations

TARGET = 0.10  # the bound on |simulated - measured| / measured


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.0f}"


def _size(n: int) -> str:
    return f"{n / 2**20:.0f} MiB" if n >= 2**20 else f"{n / 2**10:.0f} KiB"


def _rate(bytes_per_s: float) -> str:
    if bytes_per_s >= 1e9:
        return f"{bytes_per_s / 1e9:.2f} GB/s"
    return f"{bytes_per_s / 1e6:.0f} MB/s"


def _link(link: dict, case: dict) -> list[str]:
    by_size = ", ".join(
        f"{_rate(b)} for {_size(n)}" for n, b in zip(link["sizes"], link["bandwidth_by_size"])
    )
    return [
        "The simulations use the hardware file's figures for this machine "
        "(`configs/hardware/cpu.json`, measured once by `benchmarks/calibrate.py`): "
        f"a message takes {case['file_latency_s'] * 1e6:.0f} us + bytes / "
        f"{_rate(case['file_bandwidth'])}, an optimizer step its parameters' weights, "
        "gradients and state read and written at the measured step bandwidth (the *step* "
        "column below). The column beside uses the link measured during this run instead: "
        f"gloo ping-pong between two local one-thread ranks, one way: {by_size}, fitted to "
        f"{link['link_latency_s'] * 1e6:.0f} us + bytes / {_rate(link['link_bandwidth'])}.",
        "",
    ]


def _cores(cores) -> str:
    return "?" if cores is None else f"{cores:.2f} cores"


def _table(cases: list[dict]) -> list[str]:
    lines = [
        "| plan | stages (stage→rank) | simulated s/step | with the link measured now | "
        "stages timed whole | measured s/step | error | other load | machine, run / profile |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for c in cases:
        m = c["measured"]
        stages = ", ".join(f"{s}→{g}" for s, g in c["stages"])
        mark = "" if abs(c["error"]) <= TARGET else " ✗"
        lines.append(
            f"| {c['label']} | {stages} | {c['simulated_step_s']:.3f} | "
            f"{c['simulated_step_s_link_now']:.3f} | {c.get('simulated_step_s_stages', 0):.3f} | "
            f"{m['step_s']:.3f} ± {m['step_std_s']:.3f}{_range(m)} | "
            f"{c['error']:+.1%}{mark} | {_cores(m.get('other_cores'))} | "
            f"{_slower(c)} |"
        )
    return lines + [""]


def _range(m: dict) -> str:
    """The fastest and slowest run's mean step, when the package ran more than once."""
    runs = m.get("runs_step_s") or []
    return f" ({min(runs):.3f}–{max(runs):.3f})" if len(runs) > 1 else ""


def _spread(cases: list[dict]) -> list[str]:
    """How far the same package's runs were apart: the noise the errors sit in."""
    spans = [
        (max(r) / min(r) - 1, c)
        for c in cases
        if len(r := c["measured"].get("runs_step_s") or []) > 1
    ]
    if not spans:
        return []
    span, c = max(spans, key=lambda x: x[0])
    return [
        f"The same package's runs differed by up to {span:.0%} in mean step "
        f"({c['label']}): nothing in a plan or a profile can predict that part.",
        "",
    ]


def _slower(c: dict) -> str:
    """How much longer the same fixed work took around the run than after the profile."""
    m = c.get("machine_s")
    return "?" if not m else f"{m['run'] / m['profile']:.2f}x"


def _machine(cases: list[dict]) -> list[str]:
    """What the probe says about the errors: the machine's own change of speed."""
    probed = [c for c in cases if c.get("machine_s")]
    if not probed:
        return []
    worst = max(probed, key=lambda c: abs(c["machine_s"]["run"] / c["machine_s"]["profile"] - 1))
    ratio = worst["machine_s"]["run"] / worst["machine_s"]["profile"]
    return [
        "*Machine, run / profile*: one fixed piece of one-thread work (the LM head's forward "
        "and backward products, `benchmarks/harness/probe.py`) timed right after the compile "
        "profiled the plan and around the run; above 1, the machine itself was slower during "
        f"the run (by up to {ratio - 1:+.0%} here, {worst['label']}), which no profile taken "
        "earlier can foresee. This VM shares its host: one stage's forward, alone on one "
        "thread, has taken 200 ms and 260 ms seconds apart, no steal time counted.",
        "",
    ]


def _stage_rows(c: dict) -> list[str]:
    lines = [
        f"{c['label']}, per stage and action, ms (measured: mean per action, waits for "
        "messages and all-reduces excluded; in brackets the part of it the rank's thread "
        "spent in the kernel, mapping and zeroing fresh memory above all):",
        "",
        "| stage | rank | F profile | F run | B profile (+ recompute) | B run | step model "
        "| step run |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for s, p in sorted(c["profile"].items(), key=lambda kv: int(kv[0])):
        a = (c["actions"] or {}).get(s, {})
        b_prof = p["bwd_s"] + (p["recompute_s"] if p["recompute"] else 0.0)
        cell = {k: _action(a[k]) if k in a else "-" for k in "FBS"}
        lines.append(
            f"| {s} | {p['gpu']} | {_ms(p['fwd_s'])} | {cell['F']} | {_ms(b_prof)} | "
            f"{cell['B']} | {_ms(p.get('step_s', 0.0))} | {cell['S']} |"
        )
    return lines + [""]


def _action(a: dict) -> str:
    """Compute ms, with the kernel's part where the trace has it (format 3)."""
    kernel = f" ({_ms(a['sys_s'])})" if "sys_s" in a else ""
    return _ms(a["compute_s"]) + kernel


def _budget(c: dict) -> dict | None:
    """The busiest rank's step, simulated and measured (seconds per step): compute in F and
    B, optimizer-step actions, waiting for messages, and time between actions."""
    acts = c["actions"]
    if not acts:
        return None
    ranks: dict[int, dict[str, float]] = {}
    kernel: dict[int, float] = {}  # per step, where the trace has it
    for s, p in c["profile"].items():
        r = ranks.setdefault(p["gpu"], {"compute": 0.0, "step": 0.0, "wait": 0.0})
        for kind, a in acts.get(s, {}).items():
            r["step" if kind == "S" else "compute"] += a["compute_per_step_s"]
            r["wait"] += a["wait_per_step_s"]
            if "sys_s" in a and a["compute_s"] > 0:
                per_step = a["compute_per_step_s"] / a["compute_s"]  # actions per step
                kernel[p["gpu"]] = kernel.get(p["gpu"], 0.0) + a["sys_s"] * per_step
    g, r = max(ranks.items(), key=lambda kv: kv[1]["compute"] + kv[1]["step"])
    sim, real = c["simulated_step_s"], c["measured"]["step_s"]
    busy = c["busy_fraction"][g]
    step = sum(p.get("step_s", 0.0) for p in c["profile"].values() if p["gpu"] == g)
    return {
        "rank": g,
        "sim": {
            "compute": busy * sim,
            "step": step,
            "wait": (1 - busy) * sim - step,
            "other": 0.0,
        },
        "run": {**r, "other": real - sum(r.values())},
        "kernel": kernel.get(g),
    }


def _budget_rows(cases: list[dict]) -> list[str]:
    lines = [
        "Where the busiest rank's step goes, ms per step, simulated / measured: compute (F "
        "and B), the optimizer-step actions (AdamW, clipping), waiting "
        "for messages (the simulator's idle time), and what falls between actions (the rest of "
        "the measured step; a few ms below zero where the step boundaries, taken when the loss "
        "stage ends a step's forwards, do not line up with the actions counted for the step):",
        "",
        "| plan | rank | compute | step actions | waiting | between | step |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for c in cases:
        b = _budget(c)
        if b is None:
            lines.append(f"| {c['label']} | no action timings | | | | | |")
            continue
        cells = [f"{_ms(b['sim'][k])} / {_ms(b['run'][k])}" for k in ("compute", "step", "wait")]
        lines.append(
            f"| {c['label']} | {b['rank']} | " + " | ".join(cells) + f" | {_ms(b['run']['other'])}"
            f" | {_ms(c['simulated_step_s'])} / {_ms(c['measured']['step_s'])} |"
        )
    lines.append("")
    for c in cases:
        b = _budget(c)
        if b is not None:
            # error > 0: the simulation is slower, so look for what the run spent less on
            extra = {k: b["run"][k] - b["sim"][k] for k in b["run"]}
            sign = -1 if c["error"] > 0 else 1
            part = max(extra, key=lambda k: sign * extra[k])
            kernel = (
                ""
                if b["kernel"] is None
                else f"; rank {b['rank']}'s thread spent {_ms(b['kernel'])} ms of each step "
                "in the kernel"
            )
            lines.append(
                f"- {c['label']}: the largest part of the {c['error']:+.1%} is "
                f"{_PARTS[part]} ({_ms(abs(extra[part]))} ms per step "
                f"{'less' if extra[part] < 0 else 'more'} in the run than simulated){kernel}."
            )
    return lines + [""]


_PARTS = {
    "compute": "compute time differing from the profile",
    "step": "the optimizer-step actions",
    "wait": "waiting for messages",
    "other": "time between actions",
}


def _runs(n: int) -> str:
    if n < 2:
        return ""
    return (
        f"Each package ran {n} times, in {n} rounds of every package once (a slower stretch "
        "of the machine falls on all alike); *measured* is the median run's mean step "
        "± the spread of its steps, in brackets the fastest and the slowest run's mean, and "
        "the action timings below are the median run's. "
    )


def markdown(d: dict) -> str:
    cases = d["cases"]
    worst = max(cases, key=lambda c: abs(c["error"]))
    lines = [
        "## 4. Simulator fidelity: simulated vs measured step time on CPU",
        "",
        f"`{d['model']}` plans compiled with a measured profile taken on one thread "
        "(`--profile measured --hardware cpu`, OMP_NUM_THREADS=1), simulated under their "
        "schedule from that profile, each stage's times its ops' summed (what `ftpipe compile` "
        "simulates to choose a plan; *stages timed whole*: the same plan simulated with each "
        "stage timed as one block instead, one thread, alone, before the run: "
        "`benchmarks/fidelity/stage_times.py`), "
        "then trained on 2 one-thread ranks (gloo) with the package's defaults: "
        f"{d['warmup_steps']} set-up steps (a run's second step is still up to 40% slower than "
        f"later ones), {d['timed_steps']} timed steps and a final untimed one. "
        + _runs(d.get("runs", 1))
        + "*Other load*: CPU that processes other than the benchmark's used during the "
        "run (this machine is shared).",
        "",
        *_link(d["link"], cases[0]),
        *_table(cases),
        *_spread(cases),
        *_machine(cases),
    ]
    shown = [c for c in cases if c.get("timelines")]
    if shown:
        lines += [
            "Each plan's simulated and measured timelines, one above the other (`ftpipe simulate "
            "PLAN --compare TRACE --report`): "
            + ", ".join(f"[{c['name']}]({c['timelines']})" for c in shown)
            + ".",
            "",
        ]
    within = [c for c in cases if abs(c["error"]) <= TARGET]
    lines += [
        f"{len(within)} of {len(cases)} plans within ±{TARGET:.0%}; the largest error is "
        f"{worst['error']:+.1%} ({worst['label']}).",
        "",
        *_budget_rows(cases),
    ]
    for c in cases:
        lines += _stage_rows(c)
    return "\n".join(lines)
