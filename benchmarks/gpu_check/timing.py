"""Timing on the device the check runs on: CUDA events on a GPU, perf_counter on a CPU.

seconds = timed(check.device, fn, repeats=5)     # the median, after one warm-up
"""

from __future__ import annotations

import statistics
import time

__all__ = ["peak_bytes", "reset_peak", "sync", "timed", "timed_in_turn"]


def sync(device: str) -> None:
    if device == "cuda":
        import torch

        torch.cuda.synchronize()


def timed(device: str, fn, repeats: int = 5, warmup: int = 1) -> float:
    """The median seconds of `fn()` over `repeats` runs after `warmup` ones."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        if device == "cuda":
            import torch

            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def timed_in_turn(device: str, fns: dict, repeats: int = 5, warmup: int = 1) -> dict:
    """{name: the median seconds of `fns[name]()`}, the functions run in turn each round: a
    drift of the device's clock or temperature during the measurement falls on all alike
    (timed one after the other, three runs of the same comparison gave 1.02x to 1.07x)."""
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    times: dict = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            times[name].append(timed(device, fn, repeats=1, warmup=0))
    return {name: statistics.median(t) for name, t in times.items()}


def reset_peak(device: str) -> int:
    """Start counting the device's peak memory; the bytes allocated now (its baseline)."""
    if device != "cuda":
        return 0
    import torch

    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    return torch.cuda.memory_allocated()


def peak_bytes(device: str) -> dict:
    """{"allocated", "reserved"} peaks since `reset_peak` (empty on a CPU: no resettable peak)."""
    if device != "cuda":
        return {}
    import torch

    torch.cuda.synchronize()
    return {
        "allocated": torch.cuda.max_memory_allocated(),
        "reserved": torch.cuda.max_memory_reserved(),
    }
