"""The HTML report of a simulation: a per-GPU timeline, FTPipe's Figure 8 memory chart,
what each stage holds, and the plans that competed, the winner marked.

    html = render_report(plan, result, command="ftpipe simulate plan.json")
    write_report("report.html", plan, result, command)

All geometry and every figure's text are made here (sizes and times in the units of
`ftpipe_compiler.units`); `templates/report.html.j2` only places them, so the template stays
declarative and every value it prints is escaped.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import jinja2
from ftpipe_runtime.atomic import write_atomic

from .. import resources
from ..graph.granularity import layer_key, layer_runs
from ..plan import Plan, describe_remat
from ..units import duration, rate, size
from ..version import __version__
from .host import HOST_KINDS
from .network import shard_lines
from .result import SimResult
from .simulator import offload_report

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


HOST_FILLS = {"D": "#5b8def", "C": "#b03a2e", "U": "#f0a33a", "O": "#8e6bbf", "I": "#c9b3ea"}


def timeline(plan: Plan, events, prefix: str = "") -> dict:
    """Rows are GPUs; a box per action (`events`: a SimResult's timeline, or a measured
    run's), coloured by stage: F solid, B hatched, R (recompute then backward) dark and
    hatched, W (a split backward's weight gradients) pale; a black tick where a stage takes
    an optimizer step. Below them a row per GPU whose stages offload, its host link and the
    CPU (`host.HOST_KINDS`, coloured by kind). `prefix` keeps the patterns of two drawings
    on one page apart."""
    span = max((e.end for e in events), default=0.0) or 1.0
    scale = PLOT_W / span
    hosts = sorted({e.gpu for e in events if e.kind in HOST_KINDS})
    row = {("gpu", g): g for g in range(plan.gpus)}
    row.update({("host", g): plan.gpus + i for i, g in enumerate(hosts)})
    boxes, marks = _boxes(events, scale, prefix, row)
    stages = sorted({s.id for s in plan.stages})
    labels = [f"GPU {g}" for g in range(plan.gpus)] + [f"host {g}" for g in hosts]
    return {
        "width": LABEL_W + PLOT_W + 16,
        "height": AXIS_H + len(labels) * ROW_H + 8,
        "rows": [
            {
                "y": AXIS_H + i * ROW_H,
                "h": ROW_H,
                "label": label,
                "mid": AXIS_H + i * ROW_H + ROW_H / 2 + 4,
            }
            for i, label in enumerate(labels)
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
        "bottom": AXIS_H + len(labels) * ROW_H,
        "host": [
            {"fill": HOST_FILLS[k], "text": what}
            for k, what in HOST_KINDS.items()
            if any(e.kind == k for e in events)
        ],
    }


_WHAT = {"F": "forward", "B": "backward", "R": "recompute + backward", "W": "weight gradients"}


def _boxes(events, scale: float, prefix: str, row: dict) -> tuple[list[dict], list[dict]]:
    """A box per action and a tick per optimizer step, in SVG coordinates."""
    boxes, marks = [], []
    for e in events:
        x = LABEL_W + e.start * scale
        host = e.kind in HOST_KINDS
        y = AXIS_H + row[("host" if host else "gpu", e.gpu)] * ROW_H
        if host:
            boxes.append(
                {
                    "x": round(x, 2),
                    "y": y + 3,
                    "w": round(max((e.end - e.start) * scale, 0.4), 2),
                    "h": ROW_H - 6,
                    "fill": HOST_FILLS[e.kind],
                    "kind": e.kind,
                    "title": f"stage {e.stage} {HOST_KINDS[e.kind]}, "
                    f"{'step' if e.kind in 'CU' else 'micro-batch'} {e.mb}: "
                    f"{e.start:.4f}-{e.end:.4f} s",
                }
            )
            continue
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
                "memory": f"{size(g.peak_memory_bytes)} / {size(cap)}",
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
    env.filters["rate"] = rate
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
        competitors=competitor_table(plan),
        update=_update(plan),
        stages=stage_table(plan),
        size=size,
        sent_bytes=sum(g.bytes_sent for g in result.gpus),
        remat=describe_remat(plan),
        offload=offload_report(plan, result),
        sharded=shard_lines(plan),
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


# --- the plans that competed ---
@dataclass(frozen=True)
class Column:
    """How a key of the competitor rows (`Cell.to_json`, `Result.to_json`, the cluster
    planner's rows) shows: its header, its text, what the header's tooltip explains."""

    header: str
    text: Callable[[object], str]
    tip: str = ""
    figure: bool = True  # right-aligned, blank when the row has no plan


def _fixed(digits: int) -> Callable[[object], str]:
    return lambda v: f"{v:,.{digits}f}"


UPDATES = {"sync": "exact", "stale": "stale"}
WEIGHTS = {
    "sync": "synchronous: trains exactly as one process would",
    "stale": "asynchronous: some stages train on stale weights",
}
COLUMNS = {  # in the order shown; keys no row has are left out
    "schedule": Column("schedule", str, figure=False),
    "update": Column(
        "weights",
        lambda v: UPDATES.get(v, str(v)),
        "exact: trains as one process would (synchronous: every micro-batch of step k sees "
        "the weights of step k-1); stale: some stages train on older weights (asynchronous)",
        figure=False,
    ),
    "partitioner": Column("partitioner", str, figure=False),
    "status": Column("status", str, figure=False),
    "simulated_step_time_s": Column("step", duration, "simulated time per optimizer step"),
    "simulated_samples_per_s": Column("samples/s", rate, "simulated throughput"),
    "bubble_fraction": Column("bubble", lambda v: f"{100 * v:.1f}%", "idle share of GPU time"),
    "max_memory_bytes": Column("fullest GPU", size, "peak memory of the fullest GPU"),
    "stages": Column("stages", lambda v: f"{v:,}"),
    "period_s": Column("period", duration, "the slowest GPU's time per micro-batch"),
    "expected_speedup": Column("speedup", _fixed(1), "total compute / the slowest GPU's period"),
    "comm_bytes": Column("sent", size, "bytes between GPUs per micro-batch"),
    "orientation": Column("orientation", str, figure=False),
    "step_lower_bound_s": Column(
        "step bound", duration, "no plan under this schedule steps faster (pruning)"
    ),
    "search_seconds": Column("search", duration, "time the partitioner and simulation took"),
}
NOTES = ("note", "error")  # listed once each below the table, referenced from the status
HIDDEN = {"feasible"}  # shown as the status
STATUS = {"ok": "fits"}
FAILED = {"does not fit", "infeasible"}  # in red: the others were not tried or cannot apply


def _status(row: dict) -> str:
    if "status" in row:
        return row["status"]
    return "ok" if row.get("feasible", True) else "infeasible"


def _is_winner(row: dict, plan: Plan) -> bool:
    return (
        _status(row) == "ok"
        and row.get("partitioner") == plan.partitioner
        and row.get("schedule", plan.schedule) == plan.schedule
    )


def _update(plan: Plan) -> str:
    """How the winner's schedule updates the weights, in words, when the matrix says."""
    rule = next((r.get("update") for r in plan.competitors if _is_winner(r, plan)), None)
    return WEIGHTS.get(rule, "")


def _speed(row: dict) -> float:
    """Fastest first: the simulated step, else the period; rows without either last."""
    for key in ("simulated_step_time_s", "period_s"):
        if isinstance(row.get(key), (int, float)):
            return row[key]
    return math.inf


def competitor_table(plan: Plan) -> dict | None:
    """The competitor rows as the page shows them: a header, cells of text (a blank where a
    row has no figure, its reason in the tooltip), the winner marked, each distinct note
    once in a numbered list the status cells point to."""
    rows = list(plan.competitors)
    if not rows:
        return None
    present = {k for r in rows for k in r}
    keys = [k for k in COLUMNS if k in present or (k == "status" and "feasible" in present)]
    keys += [k for k in dict.fromkeys(k for r in rows for k in r) if k not in COLUMNS]
    keys = [k for k in keys if k not in NOTES and k not in HIDDEN]
    columns = [COLUMNS.get(k) or Column(k.replace("_", " "), _plain) for k in keys]
    notes: dict[str, int] = {}
    body = []
    order = sorted(range(len(rows)), key=lambda i: (_speed(rows[i]), i))
    for i in order:
        row = rows[i]
        status = _status(row)
        note = next((row[k] for k in NOTES if row.get(k)), "")
        note = note.removeprefix(f"{row.get('partitioner')}: ")  # the row names it
        ref = notes.setdefault(note, len(notes) + 1) if note else None
        why = f"{status}: {note}" if note else status
        cells = []
        for key, col in zip(keys, columns):
            value = status if key == "status" else row.get(key)
            blank = value is None or (key == "search_seconds" and not value)
            classes = ["num"] * col.figure + ["blank"] * blank
            if key == "status" and status in FAILED:
                classes.append("bad")
            cells.append(
                {
                    "text": "–" if blank else _shown(key, col, value),
                    "title": why if blank or key == "status" else "",
                    "class": " ".join(classes),
                    "ref": ref if key == "status" else None,
                }
            )
        body.append({"cells": cells, "winner": _is_winner(row, plan)})
    return {
        "matrix": "schedule" in present,
        "head": [{"text": c.header, "title": c.tip, "num": c.figure} for c in columns],
        "rows": body,
        "notes": [{"n": n, "text": t} for t, n in notes.items()],
    }


def _shown(key: str, col: Column, value) -> str:
    if key == "status":
        return STATUS.get(value, value)
    try:
        return col.text(value)
    except (TypeError, ValueError):  # a row written by another version: shown as it is
        return _plain(value)


def _plain(v) -> str:
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, float):
        return f"{v:.4g}"
    return "–" if v is None else str(v)


# --- what each stage holds ---
def stage_table(plan: Plan) -> list[dict]:
    """Per stage: its GPU, the layers its parameters come from (numbered runs merged), its
    parameters, what it holds throughout (weights in every version the schedule keeps,
    gradients, optimizer state), its activations per micro-batch and its compute."""
    held = {}
    for s in plan.stages:
        keys = dict.fromkeys(layer_key(name.rpartition(".")[0]) for name in s.params)
        held[s.id] = [(k, "") for k in keys]
    layers = layer_runs(held)
    numel = {p.name: math.prod(p.shape) for p in plan.params}
    rows = []
    for s in plan.stages:
        static, _ = plan.stage_memory(s, in_flight={s.id: 0}, deferred={s.id: 0})
        rows.append(
            {
                "id": s.id,
                "gpu": s.gpu,
                "layers": ", ".join(layers[s.id]) or f"no parameters ({len(s.nodes):,} ops)",
                "parameters": f"{sum(numel[n] for n in s.params):,}",
                "static": size(static),
                "activations": size(s.act_bytes),
                "received": size(s.input_bytes),
                "compute": duration(s.compute_s),
                "recompute": "yes" if s.recompute else "no",
                "offload": s.offload.words() if s.offload.any else "no",
                "sharded": f"across {plan.replicas}" if s.sharded_over(plan.replicas) > 1 else "no",
            }
        )
    return rows
