"""The test suite's `cuda`-marked tests (pytest -m cuda), in a child process: the files that
hold such tests only (collecting all of tests/ would import what the GPU machine lacks)."""

from __future__ import annotations

import re
import subprocess
import sys
import xml.etree.ElementTree as ET

from ..bootstrap import ROOT
from ..registry import Check, Findings, Skip, part

MARK = re.compile(r"pytest\.mark\.cuda\b")


def cuda_test_files() -> list[str]:
    return sorted(
        str(p.relative_to(ROOT))
        for p in (ROOT / "tests").rglob("test_*.py")
        if MARK.search(p.read_text(encoding="utf-8", errors="replace"))
    )


@part("cuda_tests", "The cuda-marked tests", cuda_s=90, cpu_s=10)
def cuda_tests(check: Check, found: Findings) -> None:
    files = cuda_test_files()
    found["files"] = files
    if check.device != "cuda":
        raise Skip(f"no GPU: the cuda-marked tests of {len(files)} files skip themselves here")
    junit = check.work / "cuda-tests.xml"
    budget = max(check.left() - 5, 10)
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-m", "cuda", "-q", "-p", "no:cacheprovider",
         f"--junitxml={junit}", *files],
        cwd=ROOT, capture_output=True, text=True, timeout=budget,
    )  # fmt: skip
    found["exit_status"] = proc.returncode
    found["output_tail"] = proc.stdout.strip().splitlines()[-15:]
    if not junit.is_file():
        found.expect(False, f"pytest wrote no report (exit {proc.returncode}): "
                     f"{proc.stderr.strip()[-500:]}")  # fmt: skip
        return
    suite = ET.parse(junit).getroot()
    suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
    found["tests"] = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
    for case in suite.iter("testcase"):
        bad = case.find("failure") if case.find("failure") is not None else case.find("error")
        if bad is not None:
            found.expect(False, f"{case.get('classname')}::{case.get('name')}: "
                         f"{(bad.get('message') or '')[:300]}")  # fmt: skip
    found.expect(proc.returncode in (0, 5), f"pytest exited with {proc.returncode}")
