"""Large CPU tensors on transparent huge pages: decided before torch loads.

    ftpipe_runtime.prepare_process()  # first: a package's entry point and `ftpipe` call it
    import torch                      # torch then puts tensors of 2 MB or more on huge pages

PyTorch's CPU allocator returns every freed tensor of more than 32 MB to the OS (glibc maps
such blocks afresh each time), so each new one pays a page fault per 4 KB page: a GPT-2
micro-batch's 50,257-wide logits (51 MB) cost 12,565 faults, 20 ms alone and up to 115 ms
in a 2-rank run on our 2-core VM, where the faults of both ranks contend. The LM-head stage
makes several such tensors per micro-batch (logits, log-softmax, their gradients), so on a
CPU run this was up to a quarter of a step. PyTorch's own switch, THP_MEM_ALLOC_ENABLE=1
(read once, when torch loads), aligns those tensors to 2 MB and advises huge pages: ~300
faults for the same tensor. GPUs are unaffected (CUDA memory comes from torch's caching
allocator); a value the user set, 0 included, is kept.

The same switch keeps glibc's heap (`keep_heap`): by default glibc returns the top of its heap
to the OS once 2x its adaptive mmap threshold lies free there, so the few-MB temporaries of an
LM-head micro-batch (8 MB chunks of log-softmax) were mapped afresh every micro-batch too
(5,232 page faults per forward of the benchmark's head stage; 302 with the heap kept). A
1 GiB trim threshold keeps what a step freed for the next one. The mmap threshold is fixed at
2 MB: blocks from there up (huge-page aligned by the switch) are mapped and unmapped when
freed, so the heap holds only smaller ones. With glibc's largest, 32 MB, the weight-sized
blocks between (17 MB in a 0.5B model) stayed in the heap, and where they landed among its
holes was chance: a 2-rank PipeDream-2BW run's rank 1 peaked 1.07-1.15 x its plan from run to
run; at 2 MB, 1.05. The page faults per step of the runtime benchmark's runs stayed the same
(17.5k / 35.6k per rank against 18.3k / 35.3k; 31.3k / 152 against 31.1k / 67).
GLIBC_TUNABLES or a MALLOC_* variable the user set wins. `release_free_heap` hands what is
free back on demand: the measured profiler reads RSS as the live tensors, and a run calls it
after every optimizer step, since a heap kept whole grows past what is live: tensors that
outlive a step (weight versions, gradients, receive buffers) land past holes that smaller
ones split (a 2-rank PipeDream-2BW run of 8 MB tensors grew from 90 to 294 MB in 40 steps
with under 100 MB of tensors live; given back every step, it stayed at ~190 MB).
"""

from __future__ import annotations

import ctypes
import functools
import os
import sys

__all__ = ["VARIABLE", "keep_heap", "prepare_process", "release_free_heap", "use_huge_pages"]

VARIABLE = "THP_MEM_ALLOC_ENABLE"


def use_huge_pages() -> None:
    """Ask torch for huge pages unless the user decided. Too late once torch is loaded: it
    read the environment then, so nothing changes."""
    if "torch" not in sys.modules:
        os.environ.setdefault(VARIABLE, "1")


def prepare_process() -> None:
    """The CPU allocator's settings for a run or a measured profile, before torch loads (called
    explicitly: importing the runtime changes nothing)."""
    use_huge_pages()
    keep_heap()


_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's malloc.h
MMAP_THRESHOLD = 2 << 20  # huge-page sized and up: mapped, and unmapped when freed
TRIM_THRESHOLD = 1 << 30


@functools.cache
def _glibc():
    """The process's glibc (already loaded: no library search), or None elsewhere (musl,
    macOS)."""
    try:
        libc = ctypes.CDLL(None)
        libc.mallopt, libc.malloc_trim  # noqa: B018 - glibc's, absent elsewhere
    except (OSError, AttributeError):
        return None
    return libc


def keep_heap() -> bool:
    """Keep freed heap memory for reuse (glibc only) when the switch is on and the user set no
    malloc tuning of their own; whether it did."""
    if os.environ.get(VARIABLE) != "1" or "GLIBC_TUNABLES" in os.environ:
        return False
    if any(k.startswith("MALLOC_") and k.endswith("_") for k in os.environ):
        return False
    libc = _glibc()
    if libc is None:
        return False
    return bool(libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(
        libc.mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD)
    )


def release_free_heap() -> None:
    """Hand glibc's free heap back to the OS now (kept or not), so that RSS follows the live
    tensors, not glibc's cache."""
    libc = _glibc()
    if libc is not None:
        libc.malloc_trim(0)
