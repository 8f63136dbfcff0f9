"""The real link between two local CPU ranks: gloo point-to-point time per message size.

    link = measure_link(work)      # {"sizes": [...], "one_way_s": [...], "bandwidth": B/s, ...}
    torchrun --nproc_per_node 2 -m benchmarks.harness.gloo --result gloo.json     # the worker

Ping-pong between rank 0 and rank 1 (one thread each, like the pipeline ranks): a message
goes there and back `repeats` times; one way is half a round trip. `bandwidth` is the
largest message's bytes over its one-way time (the asymptote, what the simulator's
bytes / bandwidth model stands for); `latency_s` is the one-way time of the smallest.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

from ftpipe_runtime.atomic import write_atomic

SIZES = (4_096, 262_144, 4_194_304, 51_463_168)  # bytes: tiny, one GPT-2 bench activation,
REPEATS = (50, 30, 10, 3)  # a few MB, and the tied 50,257 x 256 embedding in float32


def ping_pong(rank: int, nbytes: int, repeats: int) -> float:
    """Seconds for one message of `nbytes` to go one way (rank 0 times, rank 1 echoes)."""
    import torch
    import torch.distributed as dist

    buf = torch.zeros(nbytes // 4, dtype=torch.float32)
    peer = 1 - rank
    best = float("inf")
    for _ in range(2):  # a first round opens the connection and warms the buffers
        dist.barrier()
        start = time.perf_counter()
        for _ in range(repeats):
            if rank == 0:
                dist.send(buf, peer)
                dist.recv(buf, peer)
            else:
                dist.recv(buf, peer)
                dist.send(buf, peer)
        best = min(best, (time.perf_counter() - start) / (2 * repeats))
    return best


def worker(argv=None) -> None:
    import torch.distributed as dist

    ap = argparse.ArgumentParser(description="gloo ping-pong between 2 ranks")
    ap.add_argument("--result", required=True)
    args = ap.parse_args(argv)
    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo")
    times = [ping_pong(rank, n, r) for n, r in zip(SIZES, REPEATS)]
    if rank == 0:
        write_atomic(args.result, json.dumps({"sizes": SIZES, "one_way_s": times}))
    dist.barrier()
    dist.destroy_process_group()


def measure_link(work: Path) -> dict:
    from benchmarks.harness.launch import torchrun

    work.mkdir(parents=True, exist_ok=True)
    result = work / "gloo.json"
    torchrun(["-m", "benchmarks.harness.gloo", "--result", result], work / "gloo.log")
    data = json.loads(result.read_text())
    sizes, times = data["sizes"], data["one_way_s"]
    data["bandwidth"] = sizes[-1] / times[-1]
    data["latency_s"] = times[0]
    data["bandwidth_by_size"] = [n / t for n, t in zip(sizes, times)]
    return data


if __name__ == "__main__":
    worker()
