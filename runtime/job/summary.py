"""The end of a run on this rank: every rank's actions (--trace), the HuggingFace folder
(--save-hf), and the run's summary (returned by `ftpipe_runtime.run`, written by --log-json).

    summary = finish(settled, prepared, built, first=k, wall=s, segments=rows)  # every rank

The summary holds rank 0's losses and evaluations, every rank's peak memory, optimizer
state and master bytes (as allocated: 1/d each with sharded state) and skipped (fp16) steps, and the first replica's parameter checksums with how far the other replicas'
weights are from them (0.0: identical, as data parallelism promises).
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

import torch.distributed as dist

from ..atomic import write_atomic
from ..engine.trace import write_trace
from ..train.optim import state_bytes
from .memory import memory_meter
from .ranks import all_gather, barrier
from .report import checksums, human_bytes

if TYPE_CHECKING:
    from ..engine.comm import Comm
    from ..engine.trace import Tracer
    from .context import Built, Prepared, Settled

__all__ = ["finish", "gather_trace", "save_hf"]


def gather_trace(settled: Settled, *, comm: Comm, tracer: Tracer, first: int) -> None:
    """Every rank's actions, written by rank 0 to --trace."""
    place, config = settled.place, settled.config
    mine = {"rank": place.rank, "gpu": place.gpu, "replica": place.replica, "actions": tracer.rows}
    mine["sent"] = comm.sent  # kind -> [messages, bytes]: what crossed to other ranks
    ranks = all_gather(mine, place.world, "writing the trace")
    if place.rank == 0:
        meta = {
            "schedule": settled.schedule_name,
            "micro_batches": settled.micro_batches,
            "steps": config.steps,
            "first": first,
        }
        write_trace(config.trace, ranks, meta)


def save_hf(settled: Settled, prepared: Prepared) -> None:
    """The ranks of rank 0's pipeline send their tensors, rank 0 writes the HuggingFace folder
    (--save-hf). With replicas, which hold the same weights, the others send nothing; a
    stage whose masters are sharded across them puts them together first, every replica
    of it taking part (as a checkpoint does)."""
    place, mixed = settled.place, prepared.mixed
    barrier(place.world, "saving the HuggingFace folder")
    mine = {}
    for s, mod in prepared.modules.items():
        mine.update(mod.state_dict())  # frozen weights too (a checkpoint leaves them out)
        mine.update(mixed.state_dict(s, mod))
        if s in mixed.shards:
            mine.update(prepared.optimizers[s].gather().masters)
    reps = place.reps
    ranks = reps.pipeline(reps.where(0)[0])
    if place.rank not in ranks:
        return
    traced = settled.plan["model"].get("compute_dtype", "float32")
    prepared.exporter.at_end(
        mine, place.rank, ranks, place.device, lambda p: mixed.saved_dtype(p, traced)
    )


def finish(
    settled: Settled, prepared: Prepared, built: Built, *, first: int, wall: float,
    segments: list,
) -> dict:  # fmt: skip
    """The run's summary (see the module's docstring); rank 0 says it and writes --log-json."""
    config, place, progress, mixed = settled.config, settled.place, built.progress, prepared.mixed
    mine = {
        "memory": memory_meter(str(place.device)).peaks(),
        "checksums": checksums(prepared.modules),
        "skipped_steps": mixed.skipped,
        "replica": place.replica,
        "optimizer_state_bytes": sum(map(state_bytes, prepared.optimizers.values())),
        "master_bytes": mixed.master_bytes(),
        "activation_offload": built.executor.offload.report(),
        # Optimizer offload: the rank's seconds by phase (`train.offload.PHASES`), all steps.
        "offload_seconds": mixed.offload.clock.seconds if mixed.offload is not None else None,
    }
    everyone = all_gather(mine, place.world, "finishing")
    summary = {
        "schedule": config.schedule or settled.plan["schedule"],
        "steps": config.steps,
        "first_step": first,
        "micro_batches": settled.micro_batches,
        "wall_s": wall,
        "losses": [progress.losses.get(k) for k in range(first, config.steps)],
        "samples_per_s": progress.samples_per_s(),
        "steady_samples_per_s": progress.steady_samples_per_s(),
        # Per rank: the peak the plan predicts (CUDA: allocated; CPU: resident set grown
        # since before the stages were built), and what the device held (memory.Memory).
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
        "freezes": settled.mode.decisions,
        "segments": segments,  # one per plan the run trained on
    }
    if any(e["activation_offload"] for e in everyone):  # per rank: bytes parked on the host
        summary["activation_offload"] = [e["activation_offload"] for e in everyone]
    if any(e["offload_seconds"] for e in everyone):  # per rank, None where nothing offloads
        summary["offload_seconds"] = [e["offload_seconds"] for e in everyone]
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
        if summary.get("offload_seconds"):
            progress.write(_offload_line(summary["offload_seconds"], config.steps - first))
        if config.log_json:
            write_atomic(config.log_json, json.dumps(summary, indent=1))
    if place.world > 1:
        barrier(place.world, "finishing")
        dist.destroy_process_group()
    return summary


def _offload_line(per_rank: list[dict | None], steps: int) -> str:
    """Where the optimizer offload's time went, per step, on the rank that spent most."""
    rank, seconds = max(
        ((r, s) for r, s in enumerate(per_rank) if s), key=lambda rs: sum(rs[1].values())
    )
    parts = ", ".join(
        f"{name.replace('_', ' ')} {t / max(steps, 1):.3g} s"
        for name, t in seconds.items()
        if t > 0
    )
    return f"optimizer offload, per step on rank {rank}: {parts or 'nothing timed'}"


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
