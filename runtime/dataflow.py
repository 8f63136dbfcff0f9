"""What every rank's action list implies: its messages, its optimizer steps, its weight versions.

    lists = action_lists(topo, get_schedule("ftpipe"), micro_batches, steps)
    validate(lists, topo.stage_graph(), schedule, micro_batches, steps)   # refuses bad lists
    flow = build_dataflow(topo, lists, micro_batches, schedule)
    flow.order[(0, 1)]      # keys rank 0 sends rank 1, in the order it sends them
    flow.events[1][7]       # StepEvent of the 8th action of rank 1, if it steps stages there
    flow.weights[0]         # WeightPlan: the weight version of every action of rank 0

Receivers post their receives in the sender's order (NCCL matches point-to-point messages
by order, not tag), so both ends must derive that order from the same lists. Keys:
("act", tensor, mb), ("grad", tensor, mb) and ("eval", tensor, evaluation batch).

Optimizer steps: synchronous schedules step every stage of a rank at its last S of a step
(all backwards of the step are done then), so one gradient norm across all ranks can clip.
Other schedules step every stage at its own S, alone: a weight read by several stages lives
in one of them, so no step waits for another stage's.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .schedules import Schedule, WeightPlan, weight_plan
from .topology import Topology

Key = tuple  # ("act" | "grad" | "eval", tensor name, micro-batch)


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
    weights: dict[int, WeightPlan] = field(default_factory=dict)
    micro_batches: int = 1

    def peers(self) -> list[tuple[int, int]]:
        return sorted(self.order)


def action_lists(topo: Topology, schedule: Schedule, micro_batches: int, steps: int) -> dict:
    """Every rank's action list."""
    return schedule.actions(topo.stage_infos(), micro_batches, steps)


def build_dataflow(topo: Topology, lists: dict, micro_batches: int, schedule: Schedule) -> Dataflow:
    """Messages, step points and weight versions of lists that `validate` accepted."""
    flow = Dataflow(micro_batches=micro_batches)
    policies = schedule.policies(topo.stage_infos(), micro_batches)
    for rank in range(topo.world):
        acts = lists.get(rank, [])
        # The last local consumer to run its backward sends the summed gradient upstream.
        for a in acts:
            if a.kind == "B":
                for t in topo.inputs[a.stage]:
                    tr = topo.transfers[t]
                    if tr.grad and topo.rank_of[tr.producer] != rank:
                        flow.grad_sender[(rank, t, a.mb)] = a.stage
        for a in acts:
            for dst, key in sends(topo, flow, rank, a):
                flow.order.setdefault((rank, dst), []).append(key)
        flow.events[rank] = _step_events(topo, rank, acts, schedule.synchronous)
        flow.weights[rank] = weight_plan(acts, policies, micro_batches)
    return flow


def sends(topo: Topology, flow: Dataflow, rank: int, a) -> list[tuple]:
    """(destination rank, key) of every message action `a` sends, in sending order."""
    out = []
    if a.kind in ("F", "E"):
        key = "act" if a.kind == "F" else "eval"
        for t in topo.outputs[a.stage]:
            out += [(dst, (key, t, a.mb)) for dst in topo.remote_ranks(t)]
    elif a.kind == "B":
        for t in topo.inputs[a.stage]:
            tr = topo.transfers[t]
            if flow.grad_sender.get((rank, t, a.mb)) == a.stage:
                out.append((topo.rank_of[tr.producer], ("grad", t, a.mb)))
    return out


def _step_events(topo: Topology, rank: int, acts: list, synchronous: bool) -> dict:
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
    return events
