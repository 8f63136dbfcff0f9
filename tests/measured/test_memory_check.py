"""The memory done-when, end to end: tools/check_measured_memory.py in fresh processes."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

TOOL = Path(__file__).resolve().parents[2] / "tools" / "check_measured_memory.py"


@pytest.mark.slow
def test_a_model_4x_the_limit_profiles_within_limit_plus_overhead():
    """t5-small: 60 M parameters, 0.97 GB to train in fp32 with Adam, under a 0.2 GB limit."""
    args = ["--model", "t5-small", "--limit", "0.2", "--seq-len", "64", "--repeats", "1"]
    done = subprocess.run([sys.executable, str(TOOL), *args], capture_output=True, text=True)
    print(done.stdout)
    assert done.returncode == 0, done.stdout + done.stderr[-2000:]
    assert done.stdout.strip().endswith("PASS")
