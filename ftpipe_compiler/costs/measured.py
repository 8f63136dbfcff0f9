"""Measured costs with host swapping: time every block of a model too big for the device.

    graph = measured_costs(traced, spec, granularity="layer", device="cpu", memory_limit_gb=1)
    graph.meta["measured"]     # device, repeats, largest block, peak memory, loss, cache hit

The blocks are the graph's nodes (one ATen op at `op` granularity, one layer at `layer`),
each timed on its own: no grouping and no apportioning, so at `op` granularity a tiny op's
time includes its own Python and autograd overhead (the sum of an op-level profile's
backward times runs about 2-3x the backward of the whole model on small models). Walking
the blocks in order, only the block's own parameters are on the device (`Weights`: real
weights from safetensors, else a seeded random init; real buffers), and it is fed the real
values the earlier blocks produced (`blocks`). Per block, after one warm-up, the
median of `repeats` runs of:

- fwd_s: forward under `no_grad` (what a recomputing stage runs first),
- recompute_s: forward with autograd recording (rebuilding the graph before backward; it is
  also the forward of a stage that keeps its activations),
- bwd_s: `autograd.grad` of the block's outputs, with a random upstream gradient, w.r.t. its
  trainable parameters and the float inputs that carry gradient.
- wgrad_s (the weight-gradient pass W of a split backward): bwd_s minus the same backward
  w.r.t. the inputs alone (B, timed on the same graph). Not timed on its own: autograd asked
  for the weights alone would walk back through the whole block again, which the runtime's
  W does not do. A block without weights has none; one whose inputs carry no gradient (an
  embedding lookup) is all W.

act_bytes is what autograd saved for backward, parameters excluded. Timer: perf_counter on
CPU (threads as torch has them), CUDA events on a GPU. flops and bytes_moved are the
analytic counts, for reference.

Memory: a block is admitted when its parameters, their gradients, its inputs and every
member's output fit in `memory_limit_gb`; otherwise nothing runs. The process then needs
the limit plus a fixed overhead: python, torch and the traced program (about 400 MB of RSS
for t5-tiny, 446 MB for t5-large on meta) plus a few MB of slack; t5-large with a 1 GB
limit peaks at 712 MB RSS (tools/check_measured_memory.py prints these figures).
"""

from __future__ import annotations

import platform
import sys
import time
from dataclasses import replace

import torch
from ftpipe_runtime.errors import WriteFailed
from ftpipe_runtime.job.device import use_tf32
from ftpipe_runtime.job.memory import peak_resident_bytes, resident_bytes
from tqdm import tqdm

from ..errors import FtpipeError, unknown
from ..graph.opgraph import OpGraph
from ..graph.trace import Traced
from .analytic import analytic_costs
from .blocks import Block, plan_blocks, run_blocks
from .cache import load_profile, profile_key, save_profile
from .hardware import get_hardware
from .weights import Weights

GB = 1e9


class CpuClock:
    """On one thread, the CPU time of that thread: what the ops cost on a core of their own,
    which other processes on a shared machine cannot stretch by taking the core away (a rank
    of a run has its core). On several threads, wall-clock time (their CPU times add up)."""

    def __init__(self):
        self.device = torch.device("cpu")
        self.name = "cpu"
        self.per_block_peak = False  # RSS's peak cannot be reset per block without losing it
        threads = torch.get_num_threads()
        self.now = time.thread_time if threads == 1 else time.perf_counter
        # Timings depend on how many threads ran them and how; the cache must not mix them.
        how = "thread CPU time" if threads == 1 else "wall-clock"
        self.identity = f"cpu ({platform.machine()}, {threads} threads, {how})"

    def time(self, fn, *args):
        t0 = self.now()
        out = fn(*args)
        return self.now() - t0, out

    def reset_peak(self) -> None:
        pass

    def peak_bytes(self) -> int:
        return peak_resident_bytes()  # this process's own, not its parent's (ru_maxrss)


class CudaClock:
    def __init__(self):
        if not torch.cuda.is_available():
            raise FtpipeError("CUDA is not available on this machine; use --device cpu")
        self.device = torch.device("cuda", torch.cuda.current_device())
        self.name = self.identity = torch.cuda.get_device_name(self.device)
        use_tf32(self.device, True)  # fp32 products as a run makes them (its default --tf32)
        self.per_block_peak = True
        self.base = 0

    def time(self, fn, *args):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize(self.device)
        start.record()
        out = fn(*args)
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3, out

    def reset_peak(self) -> None:
        # What the process held before the block (another model of the same process, a
        # caller's tensors) is not the block's: its peak counts from here.
        torch.cuda.reset_peak_memory_stats(self.device)
        self.base = torch.cuda.memory_allocated(self.device)

    def peak_bytes(self) -> int:
        return torch.cuda.max_memory_allocated(self.device) - self.base


DEVICES = {"cpu": CpuClock, "cuda": CudaClock}


def measured_costs(
    traced: Traced,
    spec,
    granularity: str = "op",
    device: str = "cpu",
    memory_limit_gb: float | None = None,
    repeats: int = 3,
    cache: bool = True,
    cache_dir=None,
    seed: int = 0,
    progress=None,
) -> OpGraph:
    """The costed graph (profile "measured", hardware = the device's name) of `traced`."""
    if repeats < 1:
        raise FtpipeError(f"--repeats must be at least 1, not {repeats}")
    if memory_limit_gb is not None and memory_limit_gb <= 0:
        raise FtpipeError(f"--memory-limit must be a positive number of GB, not {memory_limit_gb}")
    clock = clock_for(device)
    # FLOP and byte counts do not depend on the hardware named here.
    reference = analytic_costs(traced, get_hardware("rtx2080ti"), granularity)
    blocks = plan_blocks(traced, [(n.id, n.members) for n in reference.nodes], clock.device)
    check_memory_limit(blocks, reference, memory_limit_gb, granularity)
    weights = Weights(traced, spec, clock.device, seed)
    key = profile_key(
        spec, reference, granularity=granularity, device=clock.identity, repeats=repeats,
        seed=seed, weights=weights.source,
    )  # fmt: skip
    hit = load_profile(key, reference, cache_dir) if cache else None
    if hit is not None:
        return replace(hit, meta={**hit.meta, "measured": {**hit.meta["measured"], "cache": "hit"}})
    rss_before, t0 = resident_bytes(), time.perf_counter()
    # A bar of its own on a terminal, unless the caller shows progress (`ftpipe compile`'s one).
    bar = tqdm(total=len(blocks), desc=f"timing blocks on {device}", unit="block",
               disable=None if progress is None else True)  # fmt: skip

    def tick() -> None:
        bar.update()
        if progress is not None:
            progress(bar.n, len(blocks), f"timing blocks on {device}")

    run = run_blocks(traced, blocks, weights, clock, repeats, seed, tick)
    bar.close()
    timed = {b: dict(fwd_s=t.fwd_s, bwd_s=t.bwd_s, wgrad_s=t.wgrad_s, recompute_s=t.recompute_s,
                     act_bytes=t.act_bytes) for b, t in run["timings"].items()}  # fmt: skip
    nodes = [replace(n, **timed[n.id]) for n in reference.nodes]
    figures = _figures(
        clock, blocks, reference, run, weights.source, memory_limit_gb, repeats, seed
    )
    figures.update(rss_before_bytes=rss_before, seconds=time.perf_counter() - t0, cache="miss")
    meta = {**reference.meta, "measured": figures}
    graph = reference.with_nodes(nodes, profile="measured", hardware=clock.name, meta=meta)
    if cache:
        try:
            save_profile(key, graph, cache_dir)
        except WriteFailed as e:  # the profile itself is good: keep it, say why it is not cached
            print(f"warning: {e} (the profile is not cached)", file=sys.stderr)
    return graph


def _figures(clock, blocks, reference, run, weights, memory_limit_gb, repeats, seed) -> dict:
    """What a measured profile records of how it was taken (graph.meta["measured"])."""
    big = max(blocks, key=lambda b: b.nbytes)
    return {
        "device": clock.identity,
        "repeats": repeats,
        "seed": seed,
        "weights": weights,
        "memory_limit_bytes": None if memory_limit_gb is None else int(memory_limit_gb * GB),
        "largest_block": {"id": big.id, "scope": reference.node[big.id].scope, "bytes": big.nbytes},
        # Peak RSS of the process on CPU; on CUDA max_memory_allocated of the biggest block.
        "peak_bytes": max(t.peak_bytes for t in run["timings"].values()),
        "block_peak_bytes": {
            b: t.peak_bytes for b, t in run["timings"].items() if clock.per_block_peak
        },
        "loss": run["loss"],
    }


def measure_stages(traced: Traced, spec, stages, device="cpu", repeats=3, seed=0) -> dict:
    """Each stage of a plan timed as ONE block, the code it runs as a whole: {stage id: Timing}.

    `stages`: (id, graph node ids) in an order where every stage's inputs come from stages
    before it (a plan's stage ids are). The op-level profile the partitioners need times
    every op apart, and its sum over a stage is not the stage's time: each op's own
    autograd call, fresh gradient buffers and cold inputs add up (the sum of an op
    profile's backward runs well above the stage's backward). A plan is judged better on
    the time of what its stages run."""
    clock = clock_for(device)
    index = {n.id: i for i, n in enumerate(traced.graph.nodes)}
    members = {n.id: n.members for n in traced.graph.nodes}
    groups = [
        (sid, tuple(m for n in sorted(ids, key=index.__getitem__) for m in members[n]))
        for sid, ids in stages
    ]
    blocks = plan_blocks(traced, groups, clock.device)
    weights = Weights(traced, spec, clock.device, seed)
    return run_blocks(traced, blocks, weights, clock, repeats, seed)["timings"]


def clock_for(device: str):
    if device not in DEVICES:
        raise unknown("device", device, DEVICES)
    return DEVICES[device]()


def check_memory_limit(blocks: list[Block], graph: OpGraph, limit_gb, granularity: str) -> None:
    """Fail before timing anything when one block alone needs more than the limit."""
    if limit_gb is None:
        return
    for b in blocks:
        if b.nbytes > limit_gb * GB:
            n = graph.node[b.id]
            advice = "use --granularity op" if granularity != "op" else "raise --memory-limit"
            raise FtpipeError(
                f"block {n.scope or n.id} needs {b.nbytes / GB:.2f} GB on its own (parameters, "
                f"gradients, inputs and activations), more than --memory-limit {limit_gb:g} GB; "
                f"{advice}"
            )
