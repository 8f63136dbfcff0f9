"""GPU_CHECK.md and GPU_CHECK.json: what ran where, each part's status and figures, and the
calibration the measurements propose for the hardware file (applied only on request:
`python -m benchmarks.gpu_check.apply GPU_CHECK.json --write h100-80gb`).
"""

from __future__ import annotations

import json

__all__ = ["FORMAT", "KIND", "markdown", "summary_line"]

KIND, FORMAT = "ftpipe-gpu-check", 1
STATUSES = ("passed", "failed", "skipped", "error", "timed out")


def _figure(value) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, dict):
        return ", ".join(f"{k} {_figure(v)}" for k, v in value.items())
    if isinstance(value, list) and len(value) > 8:
        return f"[{', '.join(_figure(v) for v in value[:8])}, ... ({len(value)})]"
    if isinstance(value, list):
        return f"[{', '.join(_figure(v) for v in value)}]"
    return str(value)


def _figures(figures: dict, depth: int = 0) -> list[str]:
    lines = []
    for key, value in figures.items():
        if isinstance(value, dict) and value and all(isinstance(v, dict) for v in value.values()):
            lines.append(f"{'  ' * depth}- {key}:")
            lines += _figures(value, depth + 1)
        else:
            lines.append(f"{'  ' * depth}- {key}: {_figure(value)}")
    return lines


def summary_line(report: dict) -> str:
    counts = {s: sum(p["status"] == s for p in report["parts"]) for s in STATUSES}
    said = ", ".join(f"{n} {s}" for s, n in counts.items() if n)
    return f"{said} in {report['wall_s']:.0f} s of {report['budget_s']:.0f}"


def markdown(report: dict) -> str:
    env = next((p["figures"] for p in report["parts"] if p["name"] == "environment"), {})
    gpu = env.get("gpu", {})
    where = gpu.get("name", "CPU") if report["device"] == "cuda" else "CPU (the small version)"
    lines = [
        "# GPU check",
        "",
        f"Written by `{report['command']}` on {report['date']}: {where}, torch "
        f"{env.get('torch', '?')}, CUDA {env.get('cuda', '-')}, ftpipe {env.get('ftpipe_commit')}."
        f" Raw figures: `GPU_CHECK.json`. {summary_line(report)}.",
        "",
        "| part | status | seconds | budget | note |",
        "| --- | --- | --- | --- | --- |",
    ]
    for p in report["parts"]:
        note = p.get("reason") or "; ".join(p["problems"]) or ""
        note = note.replace("|", "/").replace("\n", " ")[:300]
        lines.append(f"| {p['name']} | {p['status']} | {p['seconds']:.1f} | {p['budget_s']:.0f} "
                     f"| {note} |")  # fmt: skip
    for p in report["parts"]:
        lines += ["", f"## {p['title']} ({p['name']}: {p['status']})", ""]
        if p.get("reason"):
            lines.append(f"{p['reason']}")
            lines.append("")
        for problem in p["problems"]:
            lines.append(f"- PROBLEM: {problem}")
        lines += _figures(p["figures"])
        if p.get("traceback"):
            lines += ["", "```", *p["traceback"], "```"]
    calib = report.get("calibration")
    if calib:
        lines += ["", "## Proposed calibration", "",
                  "Not applied: `python -m benchmarks.gpu_check.apply GPU_CHECK.json --write "
                  f"{calib.get('hardware') or 'NAME'}` writes it into the hardware file.", "",
                  "```json", json.dumps(calib, indent=1), "```"]  # fmt: skip
    return "\n".join(lines) + "\n"
