"""Where this process runs and how the ranks meet: the rank's place, the small collectives
the run needs outside the schedule (gather, barrier, agreeing to start), and how a rank stops.

    place = Place.of(plan, config.device, rank)    # replica, pipeline GPU, torch device
    agree_to_start(failure, rank, world)         # every rank learns who could not start
    first = all_gather(value, world)             # a small picklable value from every rank

A collective waits as long as the peers live (`liveness`); one whose peer is gone raises
`PeerFailure` naming what the rank waited for. `die` (`liveness.die`) is the one way a rank
stops: peers told, one line, an exit code (a process group with a dead member cannot be
shut down cleanly).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..errors import PeerFailure, PipelineConfigError
from ..train.replicas import Replicas, launch_hint
from . import liveness
from .device import cap_threads, pick_device
from .liveness import die

__all__ = ["Place", "agree_to_start", "all_gather", "barrier", "die", "fault_of"]


@dataclass(frozen=True)
class Place:
    """This rank in the run: its replica, the pipeline GPU it runs, its torch device."""

    rank: int
    world: int
    replica: int
    gpu: int
    device: torch.device
    reps: Replicas

    @classmethod
    def of(cls, plan: dict, device: str, rank: int) -> Place:
        """Checks the process count against the plan and picks (and sets up) the device."""
        world = int(os.environ.get("WORLD_SIZE", 1))
        local_rank = int(os.environ.get("LOCAL_RANK", rank))
        reps = Replicas.of(plan)
        if world != reps.world:
            raise PipelineConfigError(
                f"the plan is for {reps.world} GPUs but {world} processes started; run "
                f"torchrun {launch_hint(plan)} ..."
            )
        replica, gpu = reps.where(rank)
        if device == "cuda" and not torch.cuda.is_available():
            raise PipelineConfigError("--device cuda, but torch sees no GPU here; use --device cpu")
        where = pick_device(device, local_rank)
        if where.type == "cuda":
            torch.cuda.set_device(where)
        cap_threads(int(os.environ.get("LOCAL_WORLD_SIZE", world)))
        return cls(rank, world, replica, gpu, where, reps)


def agree_to_start(failure: Exception | None, rank: int, world: int) -> None:
    """Every rank learns whether every other could start; the first that could not is named."""
    said = None if failure is None else str(failure) or type(failure).__name__
    if world > 1:
        said = next(((r, w) for r, w in enumerate(all_gather(said, world)) if w), None)
    elif said is not None:
        said = (rank, said)
    if failure is not None:
        raise failure
    if said is not None:
        raise PipelineConfigError(f"rank {said[0]} could not start: {said[1]}")


def all_gather(value, world: int, what: str = "choosing a checkpoint") -> list:
    """Every rank's `value` (a small picklable object), in rank order."""
    if world == 1:
        return [value]
    out = [None] * world
    try:
        with liveness.waiting(f"waiting for every rank while {what}"):
            dist.all_gather_object(out, value)
    except PeerFailure:
        raise
    except Exception as e:  # noqa: BLE001
        raise liveness.failure(f"a rank vanished while {what}", e) from e
    return out


def barrier(world: int, what: str) -> None:
    if world > 1:
        try:
            with liveness.waiting(f"waiting for every rank while {what}"):
                dist.barrier()
        except PeerFailure:
            raise
        except Exception as e:  # noqa: BLE001
            raise liveness.failure(f"a rank never arrived while {what}", e) from e


def fault_of(rank: int):
    """(step, mode, seconds) from FTPIPE_FAULT=rank:step:mode[:seconds], after this rank's
    last action of `step`: exit, hang (alive, never progressing), raise (an unexpected
    error) or slow (busy that many seconds, then on), for the tests of a peer that fails
    or is only slow."""
    text = os.environ.get("FTPIPE_FAULT", "")
    if not text:
        return None
    r, step, mode, *seconds = text.split(":")
    return (int(step), mode, float(seconds[0]) if seconds else 0.0) if int(r) == rank else None
