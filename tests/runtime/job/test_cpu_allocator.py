"""Huge pages for large CPU tensors: asked for by `ftpipe_runtime.prepare_process()` before
torch loads (what a package's entry point and `ftpipe` call); importing the runtime alone
changes nothing."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from ftpipe_runtime.job.cpu_allocator import VARIABLE

# What torch read, and the page faults of making a fresh 64 MB tensor (beyond glibc's
# largest mmap threshold, so every one is mapped afresh) in that process.
PROBE = """
import os, resource, sys
{first}
import torch
x = torch.ones(2**24)
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(3):
    y = x * 2
    del y
print(os.environ.get("{var}"), (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) // 3)
"""


def _child(code: str, **env) -> list[str]:
    """The words `code` prints in a fresh interpreter, VARIABLE unset unless `env` sets it."""
    env = {**{k: v for k, v in os.environ.items() if k != VARIABLE}, **env}
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          check=True).stdout.split()  # fmt: skip


def probe(first: str, value: str | None = None) -> tuple[str, int]:
    out = _child(
        PROBE.format(first=first, var=VARIABLE), **({} if value is None else {VARIABLE: value})
    )
    return out[0], int(out[1])


def thp_possible() -> bool:
    path = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    return path.exists() and "[never]" not in path.read_text()


FIRST = "import ftpipe_runtime\nftpipe_runtime.prepare_process()"


def test_preparing_the_process_first_turns_huge_pages_on_and_spares_the_faults():
    seen, faults = probe(FIRST)
    default_seen, default_faults = probe("", None)
    assert seen == "1" and default_seen == "None"
    if not thp_possible():
        pytest.skip("this kernel has transparent huge pages off")
    # 64 MB in 4 KB pages is 16,384 faults; on 2 MB pages a few dozen
    assert default_faults > 16_000
    assert faults < default_faults / 10


def test_a_users_setting_wins_and_a_late_import_changes_nothing():
    assert probe(FIRST, "0")[0] == "0"
    late = "import torch\n" + FIRST
    assert probe(late)[0] == "None"  # torch had already read the allocator's settings


def test_importing_the_runtime_changes_nothing():
    assert probe("import ftpipe_runtime")[0] == "None"


def test_a_generated_package_prepares_the_process_before_anything_loads_torch():
    template = Path(__file__).parents[3] / "templates" / "package" / "__init__.py.j2"
    text = template.read_text()
    first_import = min(text.index("from ftpipe_runtime."), text.index("from . import stages"))
    assert text.index("ftpipe_runtime.prepare_process()") < first_import


# Page faults of making and freeing five 8 MB tensors (below the mmap threshold: glibc's
# heap), after a first round; `MALLOC_TOP_PAD_` at glibc's default is a user's own tuning.
HEAP = """
import resource
import ftpipe_runtime
ftpipe_runtime.prepare_process()
import torch
def once():
    xs = [torch.ones(2**21) for _ in range(5)]
    del xs
once()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(3):
    once()
print((resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) // 3)
"""


def heap_faults(**env) -> int:
    return int(_child(HEAP, **env)[-1])


KEPT = """
from ftpipe_runtime.job.cpu_allocator import keep_heap, use_huge_pages
use_huge_pages()
print(keep_heap())
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's heap")
def test_the_heap_is_kept_unless_the_user_tuned_malloc():
    assert _child(KEPT) == ["True"]
    assert _child(KEPT, MALLOC_TOP_PAD_="131072") == ["False"]  # the user's setting: left alone
    assert _child(KEPT, GLIBC_TUNABLES="glibc.malloc.trim_threshold=0") == ["False"]
    assert _child(KEPT, **{VARIABLE: "0"}) == ["False"]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's heap")
def test_a_kept_heap_maps_fewer_pages_between_rounds():
    # 40 MB a round: ~10,000 faults in 4 KB pages when mapped afresh, none when the heap is
    # kept whole; but this VM's host takes back free pages of it at times (0 to ~2,100 faults
    # a round were seen, depending on the host's memory pressure), and glibc's own adaptive
    # threshold keeps much of it too (~2,600 a round; ~1,500 to 9,500 with the switch off).
    # The fewest of three children is the heap's own behaviour.
    kept = min(heap_faults() for _ in range(3))
    switched_off = min(heap_faults(**{VARIABLE: "0"}) for _ in range(2))
    assert kept < switched_off
