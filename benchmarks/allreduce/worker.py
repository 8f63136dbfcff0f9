"""One rank of the all-reduce timing (section `allreduce`, and `benchmarks.calibrate`).

torchrun --nproc_per_node 4 -m benchmarks.allreduce.worker --result r.json --sizes 1000000
"""

from __future__ import annotations

import argparse
import json
import os
import time

from ftpipe_runtime.atomic import write_atomic

ROUNDS = 12
SIZES = tuple(n * 1_000_000 for n in (1, 2, 4, 8, 16, 32, 64, 100))


def time_allreduce(sizes: list[int], rounds: int = ROUNDS) -> list[float]:
    """Fastest seconds of one blocking all-reduce of each size on every rank (rank 0's clock),
    over `rounds` rounds of one all-reduce per size."""
    import torch
    import torch.distributed as dist

    bufs = [torch.ones(n // 4, dtype=torch.float32) for n in sizes]
    for buf in bufs:  # warm-up: connections, buffers, pages
        dist.all_reduce(buf)
    best = [float("inf")] * len(sizes)
    for _ in range(rounds):
        for i, buf in enumerate(bufs):
            dist.barrier()
            start = time.perf_counter()
            dist.all_reduce(buf)
            best[i] = min(best[i], time.perf_counter() - start)
    return best


def worker(argv=None) -> None:
    import torch.distributed as dist

    ap = argparse.ArgumentParser(description="gloo all-reduce times per message size")
    ap.add_argument("--result", required=True)
    ap.add_argument("--sizes", default=",".join(map(str, SIZES)))
    ap.add_argument("--rounds", type=int, default=ROUNDS)
    args = ap.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",")]
    dist.init_process_group("gloo")
    times = time_allreduce(sizes, args.rounds)
    if int(os.environ["RANK"]) == 0:
        write_atomic(args.result, json.dumps({"sizes": sizes, "seconds": times}))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    worker()
