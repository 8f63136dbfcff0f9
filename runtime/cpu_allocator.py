"""Large CPU tensors on transparent huge pages: decided before torch loads.

    import ftpipe_runtime        # first: a package's __init__ and the compiler import it so
    import torch                 # torch then puts tensors of 2 MB or more on huge pages

PyTorch's CPU allocator returns every freed tensor of more than 32 MB to the OS (glibc maps
such blocks afresh each time), so each new one pays a page fault per 4 KB page: a GPT-2
micro-batch's 50,257-wide logits (51 MB) cost 12,565 faults, 20 ms alone and up to 115 ms
in a 2-rank run on our 2-core VM, where the faults of both ranks contend. The LM-head stage
makes several such tensors per micro-batch (logits, log-softmax, their gradients), so on a
CPU run this was up to a quarter of a step. PyTorch's own switch, THP_MEM_ALLOC_ENABLE=1
(read once, when torch loads), aligns those tensors to 2 MB and advises huge pages: ~300
faults for the same tensor. GPUs are unaffected (CUDA memory comes from torch's caching
allocator); a value the user set, 0 included, is kept.
"""

from __future__ import annotations

import os
import sys

__all__ = ["VARIABLE", "use_huge_pages"]

VARIABLE = "THP_MEM_ALLOC_ENABLE"


def use_huge_pages() -> None:
    """Ask torch for huge pages unless the user decided. Too late once torch is loaded: it
    read the environment then, so nothing changes."""
    if "torch" not in sys.modules:
        os.environ.setdefault(VARIABLE, "1")
