"""The HTML report of a simulation: a per-GPU timeline and FTPipe's Figure 8 memory chart.

    html = render_report(plan, result, command="ftpipe simulate plan.json")
    write_report("report.html", plan, result, command)

All geometry is computed here; `templates/report.html.j2` only places the shapes, so the
template stays declarative and every value it prints is escaped.
"""

from __future__ import annotations

import math

import jinja2
from ftpipe_runtime.atomic import write_atomic

from .. import resources
from ..plan import Plan, describe_remat
from ..units import gib, mib
from ..version import __version__
from .result import SimResult

LABEL_W, PLOT_W, ROW_H, AXIS_H = 64, 1100, 26, 24  # timeline, in px
SLOT_W, BOX_W, BOX_H = 128, 112, 120  # memory chart: one slot per GPU


def stage_colour(stage: int, shade: str = "mid") -> str:
    """Golden-angle hues keep neighbouring stages apart; shades tell F, B and R apart."""
    light = {"light": 86, "mid": 62, "dark": 34, "line": 45}[shade]
    return f"hsl({stage * 137.508 % 360:.1f}, 62%, {light}%)"


def _ticks(span: float, target: int = 10) -> list[float]:
    if span <= 0:
        return [0.0]
    raw = span / target
    base = 10 ** math.floor(math.log10(raw))
    step = next(m * base for m in (1, 2, 5, 10) if m * base >= raw)
    return [i * step for i in range(int(span / step) + 1)]


def timeline(plan: Plan, events, prefix: str = "") -> dict:
    """Rows are GPUs; a box per action (`events`: a SimResult's timeline, or a measured
    run's), coloured by stage: F solid, B hatched, R (recompute then backward) dark and
    hatched, W (a split backward's weight gradients) pale; a black tick where a stage takes
    an optimizer step. `prefix` keeps the patterns of two drawings on one page apart."""
    span = max((e.end for e in events), default=0.0) or 1.0
    scale = PLOT_W / span
    boxes, marks = _boxes(events, scale, prefix)
    stages = sorted({s.id for s in plan.stages})
    return {
        "width": LABEL_W + PLOT_W + 16,
        "height": AXIS_H + plan.gpus * ROW_H + 8,
        "rows": [
            {
                "y": AXIS_H + g * ROW_H,
                "h": ROW_H,
                "label": f"GPU {g}",
                "mid": AXIS_H + g * ROW_H + ROW_H / 2 + 4,
            }
            for g in range(plan.gpus)
        ],
        "ticks": [{"x": round(LABEL_W + t * scale, 2), "label": f"{t:g}"} for t in _ticks(span)],
        "patterns": [
            {
                "id": s,
                "light": stage_colour(s, "light"),
                "line": stage_colour(s, "line"),
                "dark": stage_colour(s, "dark"),
                "mid": stage_colour(s),
            }
            for s in stages
        ],
        "boxes": boxes,
        "marks": marks,
        "span": span,
        "left": LABEL_W,
        "right": LABEL_W + PLOT_W,
        "bottom": AXIS_H + plan.gpus * ROW_H,
    }


_WHAT = {"F": "forward", "B": "backward", "R": "recompute + backward", "W": "weight gradients"}


def _boxes(events, scale: float, prefix: str) -> tuple[list[dict], list[dict]]:
    """A box per action and a tick per optimizer step, in SVG coordinates."""
    boxes, marks = [], []
    for e in events:
        x = LABEL_W + e.start * scale
        y = AXIS_H + e.gpu * ROW_H
        if e.kind == "S":
            title = f"stage {e.stage} optimizer step {e.mb} at {e.start:.4f} s"
            marks.append({"x": round(x, 2), "y1": y + 1, "y2": y + ROW_H - 1, "title": title})
            continue
        fill = {
            "F": stage_colour(e.stage),
            "B": f"url(#hatch{prefix}{e.stage})",
            "R": f"url(#dark{prefix}{e.stage})",
            "W": stage_colour(e.stage, "light"),
        }[e.kind]
        boxes.append(
            {
                "x": round(x, 2),
                "y": y + 3,
                "w": round(max((e.end - e.start) * scale, 0.4), 2),
                "h": ROW_H - 6,
                "fill": fill,
                "kind": e.kind,
                "title": f"stage {e.stage} {_WHAT[e.kind]}, micro-batch {e.mb}: "
                f"{e.start:.4f}-{e.end:.4f} s",
            }
        )
    return boxes, marks


def memory_chart(plan: Plan, result: SimResult) -> dict:
    """FTPipe Fig. 8: a box per GPU whose width is its peak memory (the dashed frame is the
    capacity) and whose fill level is its utilisation."""
    cap = plan.memory_bytes
    top = max([cap, *(g.peak_memory_bytes for g in result.gpus)]) or 1
    gpus = []
    for i, g in enumerate(result.gpus):
        x = 8 + i * SLOT_W
        w = max(BOX_W * g.peak_memory_bytes / top, 1.0)
        level = BOX_H * g.busy_fraction
        gpus.append(
            {
                "x": x,
                "w": round(w, 2),
                "cap_w": round(BOX_W * cap / top, 2),
                "fill_y": round(16 + BOX_H - level, 2),
                "fill_h": round(level, 2),
                "over": g.peak_memory_bytes > cap,
                "label": f"GPU {g.gpu}",
                "memory": f"{gib(g.peak_memory_bytes):.2f} / {gib(cap):.2f} GiB",
                "busy": f"busy {100 * g.busy_fraction:.0f}%",
                "colour": stage_colour(g.stages[0]) if g.stages else "#ccc",
            }
        )
    return {
        "width": 16 + len(gpus) * SLOT_W,
        "height": BOX_H + 70,
        "top": 16,
        "box_h": BOX_H,
        "gpus": gpus,
    }


def render_report(plan: Plan, result: SimResult, command: str = "", measured=None) -> str:
    """The page; with `measured` (a MeasuredRun of the same plan) its timeline beside."""
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(resources.templates_dir()),
        undefined=jinja2.StrictUndefined,
        autoescape=True,
    )
    keys = list(dict.fromkeys(k for c in plan.competitors for k in c))
    return env.get_template("report.html.j2").render(
        plan=plan,
        result=result,
        command=command or "ftpipe simulate",
        version=__version__,
        model=plan.model.get("spec") or plan.model.get("name") or "model",
        hardware=plan.model.get("hardware", ""),
        estimate_s=plan.period_s * result.micro_batches,
        timeline=timeline(plan, result.timeline),
        measured=None
        if measured is None
        else {
            "text": compare_line(measured, result),
            "timeline": timeline(plan, measured.timeline, "m"),
        },
        memory=memory_chart(plan, result),
        timeline_steps=min(result.steps, 3),
        competitor_keys=keys,
        competitors=[[_cell(c.get(k, "")) for k in keys] for c in plan.competitors],
        gib=lambda b: f"{gib(b):.2f}",
        mib=lambda b: f"{mib(b):.2f}",
        sent_bytes=sum(g.bytes_sent for g in result.gpus),
        remat=describe_remat(plan),
    )


def write_report(path, plan: Plan, result: SimResult, command: str = "", measured=None) -> None:
    write_atomic(path, render_report(plan, result, command, measured))


def compare_line(measured, result: SimResult) -> str:
    """The measured step against the simulated one, for people."""
    return (
        f"measured {measured.step_time_s:.4f} s per step ({measured.steps} steps, "
        f"{measured.waited_s:.4f} s of it waiting for messages over all GPUs), simulated "
        f"{result.step_time_s:.4f} s: the simulation is {100 * measured.error(result):+.1f}% off"
    )


def _cell(v) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)
