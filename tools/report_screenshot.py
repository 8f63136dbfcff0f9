#!/usr/bin/env python
"""report.html as a browser draws it: headless Chromium's screenshot, cropped to the plans
that competed, the winner's row on top (docs/t5-3b-report.png; the test that a browser shows
the winner marked: tests/simulate/test_report_browser.py).

    ftpipe compile --model t5-3b --gpus 8 -o out/t5-3b
    python tools/report_screenshot.py out/t5-3b/report.html docs/t5-3b-report.png

Needs Debian's chromium (`apt-get install chromium`) and Pillow. The PNG is cropped and
quantised to 64 colours, so that it stays small in the repository.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import tempfile
from pathlib import Path

import numpy as np
from PIL import Image

# Headless, and nothing that reaches for the network (this machine has none).
FLAGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
    "--hide-scrollbars",
]  # fmt: skip
WINNER = (0xE6, 0xF4, 0xEA)  # the winner row's background (templates/report.html.j2)
ABOVE = 135  # px above the winner's row: the heading, its note and the header row


def chromium() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser")


def screenshot(html: Path, png: Path, width: int = 1280, height: int = 6000) -> Path:
    """The page, `width` px wide, down to `height` px, as Chromium renders it."""
    with tempfile.TemporaryDirectory() as profile:
        subprocess.run(
            [chromium(), *FLAGS, f"--user-data-dir={profile}", f"--window-size={width},{height}",
             f"--screenshot={png}", Path(html).resolve().as_uri()],
            check=True, capture_output=True, timeout=120,
        )  # fmt: skip
    return png


def winner_rows(png: Path) -> np.ndarray:
    """The pixel rows where the winner's background shows."""
    a = np.asarray(Image.open(png).convert("RGB")).astype(int)
    hit = (np.abs(a - np.array(WINNER)) <= 2).all(axis=2)
    return np.nonzero(hit.any(axis=1))[0]


def crop_to_plans(png: Path, out: Path, height: int = 900) -> Path:
    rows = winner_rows(png)
    if not len(rows):
        raise SystemExit(f"{png}: no winner row drawn (is this a report of a compile?)")
    top = max(0, int(rows[0]) - ABOVE)
    image = Image.open(png).convert("RGB")
    image = image.crop((0, top, image.width, min(image.height, top + height)))
    image.quantize(colors=64).save(out, optimize=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("report", type=Path)
    ap.add_argument("png", type=Path)
    args = ap.parse_args()
    if chromium() is None:
        raise SystemExit("no chromium here: apt-get install chromium")
    with tempfile.TemporaryDirectory() as tmp:
        full = screenshot(args.report, Path(tmp) / "page.png")
        crop_to_plans(full, args.png)
    print(f"wrote {args.png} ({args.png.stat().st_size:,} bytes)")


if __name__ == "__main__":
    main()
