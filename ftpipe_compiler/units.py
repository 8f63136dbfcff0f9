"""Sizes as people read them, one convention for everything ftpipe prints (compile's and
simulate's lines, report.html, the package README): binary units, GiB and MiB, as the
README's tables give memory in GiB. Link and memory bandwidths stay in GB/s, as hardware
sheets give them.

    f"{mib(result.gpus[0].bytes_sent):.2f} MiB per step"
"""

from __future__ import annotations

__all__ = ["GIB", "MIB", "gib", "mib"]

GIB = 2**30
MIB = 2**20


def gib(nbytes: float) -> float:
    return nbytes / GIB


def mib(nbytes: float) -> float:
    return nbytes / MIB
