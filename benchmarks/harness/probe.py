"""How fast this machine is right now, by one fixed piece of work: to tell a simulator's
error from the machine changing speed between the profile and the run.

    before = machine_seconds()      # after the profile
    ...                             # the run
    slower = machine_seconds() / before   # 1.2: the same work took 20 % longer

This VM shares its host: one stage's forward, alone on one thread, has taken 200 ms and
260 ms a few seconds apart, with no other process of ours running and no steal time in
/proc/stat. The work is the bench model's heaviest op, the LM head's forward and
backward (a 256 x 256 by 256 x 50,257 product and its two gradients), on one thread, like
a rank.
"""

from __future__ import annotations

import statistics
import time

import torch

__all__ = ["machine_seconds"]

TOKENS, WIDTH, VOCAB = 256, 256, 50_257  # one micro-batch of the bench model's LM head


def machine_seconds(repeats: int = 5) -> float:
    """Median seconds of the fixed work over `repeats` (about 0.3 s each), on one thread."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        g = torch.Generator().manual_seed(0)
        x = torch.randn(TOKENS, WIDTH, generator=g)
        w = torch.randn(VOCAB, WIDTH, generator=g)
        times = []
        for _ in range(repeats):
            t = time.perf_counter()
            y = x @ w.T  # forward
            x.T @ (y @ w)  # the two gradients' products, as a backward does
            y.T @ x
            times.append(time.perf_counter() - t)
        return statistics.median(times)
    finally:
        torch.set_num_threads(threads)
