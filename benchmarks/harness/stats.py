"""Step times of a run, their summary and formatting, and how busy the machine was meanwhile.

    times = step_times(ends, warmup=1, cooldown=1)     # durations of the timed steps
    stats = summarise_steps(times, samples_per_step=8)  # mean, spread, samples/s
    with OtherLoad() as load:                           # CPU other processes used meanwhile
        ...
    load.cores                                          # e.g. 0.05: 5% of one core

Two one-thread ranks fill this machine's two cores, so anything else running slows a run
down; `OtherLoad` measures it (Linux /proc/stat) so that a disturbed figure says so.
"""

from __future__ import annotations

import os
import resource
import statistics
import sys
import time


def step_times(ends: list[float], warmup: int, cooldown: int = 0) -> list[float]:
    """Durations of the steps after `warmup` and before the last `cooldown`, each from the
    end of the step before (so at least one warm-up step is needed)."""
    if warmup < 1 or warmup + cooldown >= len(ends):
        raise ValueError(f"need warmup >= 1 and warmup + cooldown < {len(ends)} steps")
    times = [b - a for a, b in zip(ends[warmup - 1 :], ends[warmup:])]
    return times[: len(times) - cooldown]


def summarise_steps(times: list[float], samples_per_step: int) -> dict:
    mean = statistics.fmean(times)
    return {
        "step_s": mean,
        "step_std_s": statistics.stdev(times) if len(times) > 1 else 0.0,
        "step_min_s": min(times),
        "step_max_s": max(times),
        "samples_per_s": samples_per_step / mean,
        "timed_steps": len(times),
        "step_times_s": list(times),
    }


def fmt_rate(stats: dict) -> str:
    """'5.12 ± 0.08' samples/s (the spread: one standard deviation of the step time)."""
    rate = stats["samples_per_s"]
    return f"{rate:.2f} ± {rate * stats['step_std_s'] / stats['step_s']:.2f}"


def fmt_ratio(a: dict, b: dict) -> str:
    """Throughput of a over b, ± its standard error (from both runs' step-time spreads)."""
    ratio = a["samples_per_s"] / b["samples_per_s"]
    rel = sum((x["step_std_s"] / x["step_s"]) ** 2 / x["timed_steps"] for x in (a, b))
    return f"{ratio:.2f} ± {ratio * rel**0.5:.2f}"


def _busy_s() -> float | None:
    """CPU seconds all processes have spent so far (every core), or None off Linux."""
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
    except OSError:
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def _ours_s() -> float:
    """CPU seconds of this process and of its children that have ended (the ranks
    `launch.torchrun` starts count: it waits for them)."""
    total = 0.0
    for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN):
        r = resource.getrusage(who)
        total += r.ru_utime + r.ru_stime
    return total


class OtherLoad:
    """Cores' worth of CPU that processes other than ours used while the block ran."""

    def __enter__(self) -> OtherLoad:
        self.cores = None
        self._start = (time.perf_counter(), _busy_s(), _ours_s())
        return self

    def __exit__(self, *exc) -> None:
        wall0, busy0, ours0 = self._start
        busy = _busy_s()
        if busy is None or busy0 is None:
            return
        other = (busy - busy0) - (_ours_s() - ours0)
        self.cores = max(other, 0.0) / max(time.perf_counter() - wall0, 1e-9)


def run_rounds(todo: dict, rounds: int, desc: str) -> dict[str, list[dict]]:
    """name -> its result in each round: every configuration runs once per round, the rounds
    one after the other, every other one in the reverse order, so a disturbance from outside
    (this machine is shared) or an order effect spreads over all of them instead of spoiling
    or favouring one; each result carries the CPU others used meanwhile. A run is called
    as run(tag, round)."""
    from tqdm import tqdm

    raw = {name: [] for name in todo}
    bar = tqdm(total=rounds * len(todo), desc=desc, file=sys.stderr, disable=None)
    for r in range(rounds):
        order = list(todo.items())
        for name, run in reversed(order) if r % 2 else order:
            with OtherLoad() as load:
                result = run(f"{name}.round{r}", r)
            raw[name].append({**result, "other_cores": load.cores})
            bar.update()
    bar.close()
    return raw
