"""The HTML report: well-formed SVG timeline and memory chart, escaped text, competitors."""

from __future__ import annotations

import re
import xml.etree.ElementTree as ET

import pytest

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
        and "<th>speedup</th>" in html
        and "<td>3.2</td>" in html
    )
    no_competitors = plan.with_(competitors=())
    assert "Partitioners that competed" not in render_report(
        no_competitors, simulate(no_competitors)
    )
    # `compile`'s matrix: a row per (schedule, partitioner).
    cells = ({"schedule": "zb1p", "partitioner": "even-layers", "status": "ok"},)
    html = render_report(plan.with_(competitors=cells), simulate(plan, steps=2))
    assert "Plans that competed (partitioner × schedule" in html and "<td>zb1p</td>" in html
