"""Sizes and times as people read them, one convention for everything ftpipe prints (compile's
and simulate's lines, report.html, the package README): binary units, KiB, MiB and GiB, as the
README's tables give memory in GiB. Link and memory bandwidths stay in GB/s, as hardware
sheets give them.

    f"{mib(result.gpus[0].bytes_sent):.2f} MiB per step"   # a column of one unit
    size(11506667840)        # '10.7 GiB': the unit that fits, so a tiny model is not '0.00 GiB'
    duration(0.0123)         # '12.3 ms'
    rate(1266.456)           # '1266.46' samples/s; rate(0.001317) '0.00132', not '0.00'
"""

from __future__ import annotations

import math

__all__ = ["GIB", "KIB", "MIB", "duration", "gib", "mib", "rate", "size"]

KIB = 2**10
MIB = 2**20
GIB = 2**30
TIB = 2**40


def gib(nbytes: float) -> float:
    return nbytes / GIB


def mib(nbytes: float) -> float:
    return nbytes / MIB


def _three(x: float) -> str:
    """Three significant figures, no exponent: 10.7, 340, 5.30, 1,234."""
    if x >= 100:
        return f"{x:,.0f}"
    return f"{x:.1f}" if x >= 10 else f"{x:.2f}"


def size(nbytes: float) -> str:
    """Bytes in the largest binary unit that keeps the figure at 1 or more."""
    if nbytes is None or not math.isfinite(nbytes):
        return "-"
    for unit, scale in (("TiB", TIB), ("GiB", GIB), ("MiB", MIB), ("KiB", KIB)):
        if abs(nbytes) >= scale:
            return f"{_three(nbytes / scale)} {unit}"
    return f"{nbytes:,.0f} B"


def duration(seconds: float) -> str:
    """Seconds as s, ms or µs, whichever keeps the figure at 1 or more (minutes past 100 s)."""
    if seconds is None or not math.isfinite(seconds):
        return "-"
    s = abs(seconds)
    if s >= 100:
        return f"{seconds / 60:.1f} min"
    if s >= 1 or s == 0:
        return f"{_three(seconds) if seconds else '0'} s"
    if s >= 1e-3:
        return f"{_three(seconds * 1e3)} ms"
    return f"{_three(seconds * 1e6)} µs"


def rate(per_s: float) -> str:
    """A rate (samples/s) with two decimals, or three significant figures below 1: a big
    model planned for a CPU trains 0.00132 samples/s, which two decimals print as 0.00."""
    if per_s is None or not math.isfinite(per_s):
        return "-"
    if per_s == 0 or abs(per_s) >= 1:
        return f"{per_s:.2f}"
    decimals = 2 - math.floor(math.log10(abs(per_s)))
    return f"{per_s:.{decimals}f}"
