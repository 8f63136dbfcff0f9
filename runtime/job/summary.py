"""The end of a run on this rank: every rank's actions (--trace), the HuggingFace folder
(--save-hf), and the run's summary (returned by `ftpipe_runtime.run`, written by --log-json).

    summary = finish(run, start, wall, segments)   # collective: every rank calls it

The summary holds rank 0's losses and evaluations, every rank's peak memory, optimizer
state and master bytes (as allocated: 1/d each with sharded state) and skipped (fp16) steps, and the first replica's parameter checksums with how far the other replicas'
weights are from them (0.0: identical, as data parallelism promises).
"""

from __future__ import annotations

import json

import torch.distributed as dist

from ..atomic import write_atomic
from ..engine.trace import write_trace
from ..train.optim import state_bytes
from .ranks import all_gather, barrier
from .report import checksums, human_bytes, memory_meter

__all__ = ["finish", "gather_trace", "save_hf"]


def gather_trace(run, tracer, first: int) -> None:
    """Every rank's actions, written by rank 0 to --trace."""
    place = run.place
    mine = {"rank": place.rank, "gpu": place.gpu, "replica": place.replica, "actions": tracer.rows}
    mine["sent"] = run.comm.sent  # kind -> [messages, bytes]: what crossed to other ranks
    ranks = all_gather(mine, place.world, "writing the trace")
    if place.rank == 0:
        meta = {
            "schedule": run.name,
            "micro_batches": run.m,
            "steps": run.config.steps,
            "first": first,
        }
        write_trace(run.config.trace, ranks, meta)


def save_hf(run) -> None:
    """Every rank sends its tensors, rank 0 writes the HuggingFace folder (--save-hf)."""
    place, mixed = run.place, run.mixed
    barrier(place.world, "saving the HuggingFace folder")
    mine = {  # frozen weights too (a checkpoint leaves them out)
        k: v
        for s, mod in run.modules.items()
        for k, v in {**mod.state_dict(), **mixed.state_dict(s, mod)}.items()
    }
    traced = run.plan["model"].get("compute_dtype", "float32")
    run.exporter.at_end(
        mine, place.rank, place.world, place.device, lambda p: mixed.saved_dtype(p, traced)
    )


def finish(run, first: int, wall: float, segments: list) -> dict:
    """The run's summary (see the module's docstring); rank 0 says it and writes --log-json."""
    config, place, progress = run.config, run.place, run.progress
    mine = {
        "memory": memory_meter(str(place.device)).peaks(),
        "checksums": checksums(run.modules),
        "skipped_steps": run.mixed.skipped,
        "replica": place.replica,
        "optimizer_state_bytes": sum(map(state_bytes, run.optimizers.values())),
        "master_bytes": run.mixed.master_bytes(),
        "activation_offload": run.executor.offload.report(),
    }
    everyone = all_gather(mine, place.world, "finishing")
    summary = {
        "schedule": config.schedule or run.plan["schedule"],
        "steps": config.steps,
        "first_step": first,
        "micro_batches": run.m,
        "wall_s": wall,
        "losses": [progress.losses.get(k) for k in range(first, config.steps)],
        "samples_per_s": progress.samples_per_s(),
        "steady_samples_per_s": progress.steady_samples_per_s(),
        # Per rank: the peak the plan predicts (CUDA: allocated; CPU: resident set grown
        # since before the stages were built), and what the device held (report.Memory).
        "memory_bytes": [e["memory"]["allocated"] for e in everyone],
        "memory_reserved_bytes": [e["memory"]["reserved"] for e in everyone],
        "dtype": config.dtype,
        "evals": [{"step": k, **v} for k, v in sorted(progress.evals.items())],
        "skipped_steps": [e["skipped_steps"] for e in everyone],  # per rank: the same
        "optimizer_state_bytes": [e["optimizer_state_bytes"] for e in everyone],
        "master_bytes": [e["master_bytes"] for e in everyone],  # kept apart from the weights
        "checksums": _first_replica(everyone),
        # Every replica holds the same weights after every step: the first replica's,
        # compared with each other's (0.0: identical).
        "replica_difference": _replica_difference(everyone),
        "freezes": run.mode.decisions,
        "segments": segments,  # one per plan the run trained on
    }
    if any(e["activation_offload"] for e in everyone):  # per rank: bytes parked on the host
        summary["activation_offload"] = [e["activation_offload"] for e in everyone]
    if place.rank == 0:
        mem = ", ".join(
            f"rank {r} {human_bytes(a)} ({human_bytes(b)} reserved)"
            for r, (a, b) in enumerate(
                zip(summary["memory_bytes"], summary["memory_reserved_bytes"])
            )
        )
        progress.write(
            f"done: {config.steps - first} steps in {wall:.1f} s, "
            f"{summary['samples_per_s']:.1f} samples/s; peak memory {mem}"
        )
        if config.log_json:
            write_atomic(config.log_json, json.dumps(summary, indent=1))
    if place.world > 1:
        barrier(place.world, "finishing")
        dist.destroy_process_group()
    return summary


def _first_replica(everyone: list[dict]) -> dict:
    return {k: v for e in everyone if e["replica"] == 0 for k, v in sorted(e["checksums"].items())}


def _replica_difference(everyone: list[dict]) -> float:
    first = _first_replica(everyone)
    return max(
        (
            abs(a - b)
            for e in everyone
            for k, v in e["checksums"].items()
            for a, b in zip(v, first.get(k, v))
        ),
        default=0.0,
    )
