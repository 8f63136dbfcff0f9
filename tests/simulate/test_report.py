"""The HTML report: well-formed SVG timeline and memory chart, escaped text, the competitors'
table formatted with the winner marked, what each stage holds."""

from __future__ import annotations

import re
import xml.etree.ElementTree as ET
from html.parser import HTMLParser

import pytest
from markupsafe import escape  # as the template escapes

from ftpipe_compiler.simulate import render_report, simulate
from ftpipe_compiler.version import __version__

SVG = "{http://www.w3.org/2000/svg}"


def svgs(html: str) -> dict[str, ET.Element]:
    blocks = re.findall(r"<svg\b.*?</svg>", html, flags=re.S)
    trees = [ET.fromstring(b) for b in blocks]  # raises on malformed XML
    return {t.get("id"): t for t in trees}


def test_timeline_has_one_box_per_action_and_distinct_kinds(plan_factory):
    plan = plan_factory([(1.0, 2.0, 1.0)] * 4, gpu_of=[0, 1, 1, 0], micro_batches=3)
    result = simulate(plan, steps=5)
    html = render_report(plan, result, command="ftpipe simulate plan.json")
    svg = svgs(html)["timeline"]
    boxes = [r for r in svg.iter(f"{SVG}rect") if r.get("class") in ("F", "B", "R")]
    kinds = [e.kind for e in result.timeline if e.kind != "S"]
    assert sorted(r.get("class") for r in boxes) == sorted(kinds)
    # The loss stage does not recompute under ftpipe: plain hatched B; the others dark R.
    assert {r.get("class") for r in boxes} == {"F", "B", "R"}
    fills = {k: {r.get("fill").split("(")[0] for r in boxes if r.get("class") == k} for k in "FBR"}
    assert fills["F"] == {"hsl"} and fills["B"] == fills["R"] == {"url"}
    hatch = {r.get("fill") for r in boxes if r.get("class") == "B"}
    dark = {r.get("fill") for r in boxes if r.get("class") == "R"}
    assert hatch.isdisjoint(dark)
    patterns = {p.get("id") for p in svg.iter(f"{SVG}pattern")}
    assert {f[5:-1] for f in hatch | dark} <= patterns  # every url(#...) is defined
    steps = [ln for ln in svg.iter(f"{SVG}line") if ln.get("class") == "S"]
    assert len(steps) == sum(e.kind == "S" for e in result.timeline) == 4 * 3
    # Boxes stay inside the plot.
    width = float(svg.get("width"))
    assert all(
        0 <= float(r.get("x")) and float(r.get("x")) + float(r.get("width")) <= width for r in boxes
    )


def test_memory_chart_width_is_memory_and_fill_is_utilisation(plan_factory):
    plan = plan_factory([(1.0, 2.0, 1.0), (3.0, 6.0, 0.0)], micro_batches=4, memory_bytes=30_000)
    result = simulate(plan, steps=4)
    svg = svgs(render_report(plan, result))["memory"]
    boxes = [r for r in svg.iter(f"{SVG}rect") if r.get("class") == "gpu"]
    assert len(boxes) == plan.gpus
    frames = [r for r in svg.iter(f"{SVG}rect") if r.get("stroke-dasharray")]
    for g, box, frame in zip(result.gpus, boxes, frames):
        ratio = float(box.get("width")) / float(frame.get("width"))
        assert ratio == pytest.approx(g.peak_memory_bytes / plan.memory_bytes, rel=1e-3)
    fills = [
        r
        for r in svg.iter(f"{SVG}rect")
        if r.get("class") is None and not r.get("stroke-dasharray")
    ]
    heights = [float(r.get("height")) for r in fills]
    assert heights[1] > heights[0]  # GPU 1 is the bottleneck: fuller
    assert heights[1] / float(boxes[1].get("height")) == pytest.approx(
        result.gpus[1].busy_fraction, rel=1e-3
    )


def test_header_competitors_and_escaping(plan_factory):
    plan = plan_factory([(1.0, 2.0, 1.0)] * 2).with_(
        model={"spec": "<script>x</script>", "micro_batch": 1}
    )
    html = render_report(plan, simulate(plan, steps=2), command="ftpipe simulate a&b.json")
    assert "<script>" not in html and "&lt;script&gt;" in html
    assert "ftpipe simulate a&amp;b.json" in html and f"ftpipe {__version__}" in html
    assert (
        "Partitioners that competed" in html
        and '<th class="num">speedup</th>' in html
        and '<td class="num">3.2</td>' in html
    )
    no_competitors = plan.with_(competitors=())
    assert "Partitioners that competed" not in render_report(
        no_competitors, simulate(no_competitors)
    )
    # `compile`'s matrix: a row per (schedule, partitioner).
    cells = ({"schedule": "zb1p", "partitioner": "even-layers", "status": "ok"},)
    html = render_report(plan.with_(competitors=cells), simulate(plan, steps=2))
    assert "Plans that competed (partitioner × schedule" in html and "<td>zb1p</td>" in html


class Tables(HTMLParser):
    """Every table of a page by id: rows of (tr attributes, [(td attributes, text)])."""

    def __init__(self, html: str):
        super().__init__()
        self.tables: dict[str, list] = {}
        self._table = self._row = self._cell = None
        self.feed(html)

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if tag == "table":
            self._table = self.tables.setdefault(attrs.get("id", ""), [])
        elif tag == "tr" and self._table is not None:
            self._row = (attrs, [])
            self._table.append(self._row)
        elif tag in ("td", "th") and self._row is not None:
            self._cell = (attrs, [])
            self._row[1].append(self._cell)

    def handle_endtag(self, tag):
        if tag in ("td", "th") and self._cell is not None:
            self._row[1][-1] = (self._cell[0], "".join(self._cell[1]).strip())
            self._cell = None
        elif tag == "table":
            self._table = None

    def handle_data(self, data):
        if self._cell is not None:
            self._cell[1].append(data)


# Rows as `ftpipe compile` writes them (planner.matrix.Cell.to_json), for a known plan.
NOT_SEARCHED = "its best quick plan (9.612 s) is not among the 1 fastest free-placement schedules'"
MATRIX = (
    {"schedule": "gpipe", "update": "sync", "partitioner": "mixed", "status": "not searched",
     "stages": None, "period_s": None, "simulated_step_time_s": None,
     "simulated_samples_per_s": None, "bubble_fraction": None, "max_memory_bytes": None,
     "step_lower_bound_s": 5.065886510802915, "search_seconds": 0.0, "note": NOT_SEARCHED},
    {"schedule": "gpipe", "update": "sync", "partitioner": "pipedream", "status": "ok",
     "stages": 8, "period_s": 0.6023019571558326, "simulated_step_time_s": 9.61205139392219,
     "simulated_samples_per_s": 4.161442585012858, "bubble_fraction": 0.45763229584725096,
     "max_memory_bytes": 11506667840, "step_lower_bound_s": 5.065886510802915,
     "search_seconds": 1.2024669379998159, "note": ""},
    {"schedule": "ftpipe", "update": "stale", "partitioner": "test", "status": "ok",
     "stages": 23, "period_s": 0.5282656971261136, "simulated_step_time_s": 5.299,
     "simulated_samples_per_s": 7.5486, "bubble_fraction": 0.0161,
     "max_memory_bytes": 9135419588, "step_lower_bound_s": 5.065886510802915,
     "search_seconds": 13.44, "note": ""},
    {"schedule": "gpipe", "update": "sync", "partitioner": "acyclic", "status": "not searched",
     "stages": None, "period_s": None, "simulated_step_time_s": None,
     "simulated_samples_per_s": None, "bubble_fraction": None, "max_memory_bytes": None,
     "step_lower_bound_s": 5.065886510802915, "search_seconds": 0.0, "note": NOT_SEARCHED},
    {"schedule": "zbv", "update": "sync", "partitioner": "params", "status": "infeasible",
     "stages": None, "period_s": None, "simulated_step_time_s": None,
     "simulated_samples_per_s": None, "bubble_fraction": None, "max_memory_bytes": None,
     "step_lower_bound_s": 5.065886510802915, "search_seconds": 0.0866,
     "note": "params: infeasible: needs more than 8 GPUs"},
)  # fmt: skip


def test_competitor_table_is_formatted_and_marks_the_winner(plan_factory):
    plan = plan_factory([(1.0, 2.0, 1.0)] * 2).with_(competitors=MATRIX)
    html = render_report(plan, simulate(plan, steps=2))
    rows = Tables(html).tables["competitors"]
    head = [text for _, text in rows[0][1]]
    assert head == ["schedule", "weights", "partitioner", "status", "step", "samples/s",
                    "bubble", "fullest GPU", "stages", "period", "step bound", "search"]  # fmt: skip
    body = {(r[1][0][1].removesuffix("winner"), r[1][2][1]): r for r in rows[1:]}
    # Fastest first, one row each; the winner (the plan's partitioner and schedule) marked.
    assert [k for k in body] == [("ftpipe", "test"), ("gpipe", "pipedream"), ("gpipe", "mixed"),
                                 ("gpipe", "acyclic"), ("zbv", "params")]  # fmt: skip
    winners = [k for k, r in body.items() if r[0].get("class") == "winner"]
    assert winners == [("ftpipe", "test")] and html.count('class="badge">winner<') == 1
    text = {k: [t for _, t in r[1]] for k, r in body.items()}
    assert text[("ftpipe", "test")] == ["ftpipewinner", "stale", "test", "fits", "5.30 s", "7.55",
                                        "1.6%", "8.51 GiB", "23", "528 ms", "5.07 s", "13.4 s"]  # fmt: skip
    assert text[("gpipe", "pipedream")][3:8] == ["fits", "9.61 s", "4.16", "45.8%", "10.7 GiB"]
    # Cells without a figure are blank, their reason in the tooltip; the note once, below.
    cells = body[("gpipe", "mixed")][1]
    assert [t for _, t in cells][4:10] == ["–"] * 6 and cells[11][1] == "–"
    assert all(a.get("title") == f"not searched: {NOT_SEARCHED}" for a, t in cells if t == "–")
    assert html.count(f">{escape(NOT_SEARCHED)}</li>") == 1
    assert cells[3][1] == "not searched1" and text[("zbv", "params")][3] == "infeasible2"
    assert ">infeasible: needs more than 8 GPUs</li>" in html  # the row names the partitioner
    # No Python values, raw byte counts or keys of the JSON.
    table = html[html.index('<table id="competitors"') :]
    for raw in ("None", "11506667840", "0.4576", "simulated_step_time_s", "max_memory_bytes"):
        assert raw not in table, raw
    assert "(asynchronous: some stages train on stale weights)" in html


def test_stage_table_and_small_sizes(plan_factory):
    """A tiny model's memory shows in the unit that fits (never `0.00 GiB`), and each stage
    says what it holds."""
    plan = plan_factory([(1.0, 2.0, 1.0)] * 3, memory_bytes=30_000)
    result = simulate(plan, steps=2)
    html = render_report(plan, result)
    assert "0.00 GiB" not in html and "0.00 MiB" not in html
    assert "29.3 KiB" in html  # the capacity: 30,000 B
    stages = Tables(html).tables["stages"]
    assert len(stages) == 1 + len(plan.stages)
    first = [t for _, t in stages[1][1]]
    # Stage 0 holds w0: 1 parameter; 4 B weight + 9,996 B gradient and state under ftpipe's
    # weight versions (1 extra here: 4 B); activations 1,000 B; received 100 B.
    versions = plan.policies[0].weight_versions
    held = 4 * versions + 10_000 - 4
    assert first[:2] == ["0", "0"] and first[3] == "1"
    assert first[4] == (f"{held / 1024:.2f} KiB") and first[5:7] == ["1,000 B", "100 B"]
