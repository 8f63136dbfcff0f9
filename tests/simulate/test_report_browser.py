"""report.html in a real browser (headless Chromium, where installed): the competitors'
table is drawn with the winner's row marked, once."""

from __future__ import annotations

import pytest

from ftpipe_compiler.simulate import simulate, write_report

screenshots = pytest.importorskip("tools.report_screenshot")
if screenshots.chromium() is None:
    pytest.skip("no chromium here (apt-get install chromium)", allow_module_level=True)

ROW = (26, 32)  # px: a table row's height at 14 px text


def test_chromium_draws_the_winner_marked(plan_factory, tmp_path):
    from test_report import MATRIX  # rows as compile writes them, one winner

    plan = plan_factory([(1.0, 2.0, 1.0)] * 2).with_(competitors=MATRIX)
    write_report(tmp_path / "report.html", plan, simulate(plan, steps=2))
    png = screenshots.screenshot(tmp_path / "report.html", tmp_path / "page.png", height=3000)
    rows = screenshots.winner_rows(png)
    assert len(rows) and ROW[0] <= rows[-1] - rows[0] + 1 <= ROW[1]  # one row, contiguous
    crop = screenshots.crop_to_plans(png, tmp_path / "plans.png")
    assert crop.stat().st_size < 200_000
