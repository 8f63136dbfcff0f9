"""What every rank's action list implies: its messages, its optimizer steps, and that it ends.

    lists = action_lists(topo, "ftpipe", micro_batches, steps)
    flow = build_dataflow(topo, lists, micro_batches, synchronous=False)
    flow.order[(0, 1)]      # keys rank 0 sends rank 1, in the order it sends them
    flow.events[1][7]       # StepEvent of the 8th action of rank 1, if it steps stages there
    check_progress(topo, lists, flow)   # raises if executing the lists would deadlock

Receivers post their receives in the sender's order (NCCL matches point-to-point messages
by order, not tag), so both ends must derive that order from the same lists. Keys:
("act", tensor, mb) and ("grad", tensor, mb).

Optimizer steps: synchronous schedules step every stage of a rank at its last S of a step
(all backwards of the step are done then), so one gradient norm across all ranks can clip.
The asynchronous schedule steps every stage at its own S, alone: a weight read by several
stages lives in one of them, so no step waits for another stage's.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .errors import PipelineConfigError
from .schedules import StageInfo, actions
from .topology import Topology

Key = tuple  # ("act" | "grad", tensor name, micro-batch)


@dataclass(frozen=True)
class StepEvent:
    step: int
    stages: tuple[int, ...]  # this rank's stages that take their optimizer step here
    ranks: tuple[int, ...]  # ranks meeting here in collectives (the gradient norm)
    barrier: tuple  # the same value on every rank of `ranks`


@dataclass
class Dataflow:
    order: dict[tuple[int, int], list[Key]] = field(default_factory=dict)
    grad_sender: dict[tuple[int, str, int], int] = field(default_factory=dict)
    events: dict[int, dict[int, StepEvent]] = field(default_factory=dict)
    micro_batches: int = 1

    def peers(self) -> list[tuple[int, int]]:
        return sorted(self.order)


def action_lists(topo: Topology, schedule: str, micro_batches: int, steps: int) -> dict:
    """Every rank's action list."""
    infos = [
        StageInfo(s, topo.rank_of[s], topo.depth[s], s == topo.loss_stage) for s in topo.stage_ids
    ]
    return actions(schedule, infos, micro_batches, steps)


def build_dataflow(topo: Topology, lists: dict, micro_batches: int, synchronous: bool) -> Dataflow:
    flow = Dataflow(micro_batches=micro_batches)
    for rank in range(topo.world):
        acts = lists.get(rank, [])
        _check_list(topo, rank, acts, micro_batches)
        # The last local consumer to run its backward sends the summed gradient upstream.
        for a in acts:
            if a.kind == "B":
                for t in topo.inputs[a.stage]:
                    tr = topo.transfers[t]
                    if tr.grad and topo.rank_of[tr.producer] != rank:
                        flow.grad_sender[(rank, t, a.mb)] = a.stage
        for a in acts:
            for dst, key in sends(topo, flow, rank, a, micro_batches):
                flow.order.setdefault((rank, dst), []).append(key)
        flow.events[rank] = _step_events(topo, rank, acts, micro_batches, synchronous)
    return flow


def sends(topo: Topology, flow: Dataflow, rank: int, a, micro_batches: int) -> list[tuple]:
    """(destination rank, key) of every message action `a` sends, in sending order."""
    out = []
    if a.kind == "F":
        for t in topo.outputs[a.stage]:
            out += [(dst, ("act", t, a.mb)) for dst in topo.remote_ranks(t)]
    elif a.kind == "B":
        for t in topo.inputs[a.stage]:
            tr = topo.transfers[t]
            if flow.grad_sender.get((rank, t, a.mb)) == a.stage:
                out.append((topo.rank_of[tr.producer], ("grad", t, a.mb)))
    return out


def _step_events(topo: Topology, rank: int, acts: list, m: int, synchronous: bool) -> dict:
    """Where this rank applies optimizer steps: its last S of a step when synchronous (every
    local stage at once), else every S (that stage alone)."""
    local = tuple(topo.stages_on(rank))
    last: dict[tuple, int] = {}
    for i, a in enumerate(acts):
        if a.kind == "S":
            last[(local if synchronous else (a.stage,), a.mb)] = i
    events = {}
    for (group, k), i in last.items():
        if synchronous:
            events[i] = StepEvent(k, group, tuple(range(topo.world)), ("step", k))
        else:
            events[i] = StepEvent(k, group, (rank,), ("stage", group, k))
    if synchronous:  # nothing of a later step may run on weights not yet updated
        newest = -1
        for i, a in enumerate(acts):
            if i in events and newest > events[i].step:
                raise PipelineConfigError(
                    f"rank {rank} starts step {newest} before it finishes step {events[i].step}: "
                    "not a synchronous schedule"
                )
            if a.kind != "S":
                newest = max(newest, a.mb // m)
    return events


def _check_list(topo: Topology, rank: int, acts: list, m: int) -> None:
    """Every action belongs here and comes in an order the executor can honour."""
    backwards: dict[tuple[int, int], int] = {}  # (stage, step) -> backwards done
    last_f: dict[int, int] = {}
    steps_at_f: dict[tuple[int, int], int] = {}
    stepped: dict[int, int] = {}
    for a in acts:
        if a.kind not in ("F", "B", "S"):
            raise PipelineConfigError(f"rank {rank}: unknown action kind {a.kind!r}")
        if topo.rank_of.get(a.stage) != rank:
            raise PipelineConfigError(f"rank {rank} was given {a}, a stage it does not host")
        if a.kind == "F":
            if a.mb <= last_f.get(a.stage, -1):
                raise PipelineConfigError(f"rank {rank}: forwards of stage {a.stage} out of order")
            last_f[a.stage] = a.mb
            steps_at_f[(a.stage, a.mb)] = stepped.get(a.stage, 0)
        elif a.kind == "B":
            if (a.stage, a.mb) not in steps_at_f:
                raise PipelineConfigError(f"rank {rank}: {a} comes before its forward")
            if not a.recompute and steps_at_f[(a.stage, a.mb)] != stepped.get(a.stage, 0):
                raise PipelineConfigError(
                    f"rank {rank}: stage {a.stage} steps between the forward and the backward "
                    f"of micro-batch {a.mb} without recomputing; its kept graph would be stale"
                )
            key = (a.stage, a.mb // m)
            backwards[key] = backwards.get(key, 0) + 1
        else:
            if backwards.get((a.stage, a.mb), 0) != m or backwards.get((a.stage, a.mb + 1)):
                raise PipelineConfigError(
                    f"rank {rank}: step {a.mb} of stage {a.stage} does not follow exactly the "
                    f"{m} backwards of that step"
                )
            stepped[a.stage] = stepped.get(a.stage, 0) + 1


def check_progress(topo: Topology, lists: dict, flow: Dataflow) -> None:
    """Execute the lists abstractly (messages and collectives, no compute); raise if stuck."""
    pos = dict.fromkeys(range(topo.world), 0)
    sent: set = set()
    done_f: set = set()
    done_b: set = set()
    arrived: dict[tuple, set] = {}

    def ready(r: int, i: int, a) -> bool:
        if a.kind == "F":
            return all(
                (p, a.mb) in done_f
                if topo.rank_of[p] == r
                else (topo.rank_of[p], r, ("act", t, a.mb)) in sent
                for t in topo.inputs[a.stage]
                for p in [topo.transfers[t].producer]
            )
        if a.kind == "B":
            for t in topo.outputs[a.stage]:
                if not topo.transfers[t].grad:
                    continue
                if any((c, a.mb) not in done_b for c in topo.local_consumers(t, r)):
                    return False
                if any((d, r, ("grad", t, a.mb)) not in sent for d in topo.remote_ranks(t)):
                    return False
            return True
        ev = flow.events[r].get(i)
        if ev is None or len(ev.ranks) == 1:
            return True
        waiting = arrived.setdefault(ev.barrier, set())
        waiting.add(r)
        return waiting >= set(ev.ranks)

    moved = True
    while moved:
        moved = False
        for r in range(topo.world):
            acts = lists.get(r, [])
            while pos[r] < len(acts) and ready(r, pos[r], acts[pos[r]]):
                a = acts[pos[r]]
                (done_f if a.kind == "F" else done_b if a.kind == "B" else set()).add(
                    (a.stage, a.mb)
                )
                sent.update(
                    (r, dst, key) for dst, key in sends(topo, flow, r, a, flow.micro_batches)
                )
                pos[r] += 1
                moved = True
    stuck = [f"rank {r} at {lists[r][p]}" for r, p in pos.items() if p < len(lists.get(r, []))]
    if stuck:
        raise PipelineConfigError(
            "these action lists would deadlock on this plan (" + "; ".join(stuck) + "); "
            "try another schedule"
        )
