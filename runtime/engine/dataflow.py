"""What every rank's actions imply, worked out as they stream by: messages, optimizer steps, and
where each step window ends.

    flow = Dataflow(topo, Timeline(schedule, topo.stage_infos(), micro_batches, steps))
    flow = Dataflow(topo, timeline, evaluation=rounds)  # evaluate.Rounds spliced in
    for item in flow.actions(rank):  # Planned: item.action, item.sends, item.event, item.ends_step
        ...
    flow.listed(rank)                # the rank's bare actions (rank 0's loss listener reads them)
    flow.keys(0, 1).get(i)           # the i-th key rank 0 sends rank 1 (None: no more)
    flow.peers()                     # (sender, receiver) pairs that ever exchange a message

Receivers post their receives in the sender's order (NCCL matches point-to-point messages
by order, not tag), so both ends derive that order from the same lists: every rank makes
the sender's actions itself (`Timeline` is a pure function of the plan and the options).
Keys: ("act", tensor, mb), ("grad", tensor, mb), ("eval", tensor, evaluation batch: a
weight once per round, under its first batch), and ("weight", parameter, version),
("wgrad", parameter, step) (below).
Nothing is derived ahead of need, so a run of any length costs the same to start.

Weights read by other stages (tied embeddings): a weight changes only at its owner's
optimizer step, so its owner sends it once per version (`ForwardVersions`: under a
synchronous schedule once per step; under FTPipe's whenever the owner stepped since it last
sent it; under PipeDream-2BW and WPipe once per pinned version), with the first forward of
the owner that reads that version, after that forward's activations (a 51 MB embedding
sent first would hold them up on the link); under a synchronous schedule a version made by
a step goes at once after the owner's rank stepped, so that it crosses while the owner runs
its next forward instead of after it (the readers' first forward waits for both). The
readers keep it for every forward of theirs reading that version. Its gradient comes back
once per step, summed over the step's micro-batches, after the last of this rank's readers'
backwards of the step (after the activations' gradients, `grad_order`); the owner adds
it in at its own last backward of the step, which comes after (the readers' backward of a
micro-batch precedes the owner's, as with any activation), after the rest of that backward
has run, and steps after that backward whatever the schedule.

Gradients: a backward sends the gradient of an input upstream when it is the last of this
rank's readers of that tensor to run for that micro-batch (each reader runs exactly one
backward per micro-batch, so they are counted, not looked ahead for); the readers before
it add theirs to the sum it sends.

Optimizer steps: synchronous schedules step every stage of a rank at its last S of a step
(all backwards of the step are done then), so one gradient norm across all ranks can clip.
Other schedules step every stage at its own S, alone: a weight read by several stages lives
in one of them, so no step waits for another stage's.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass

from ..schedules import Action, ForwardVersions, Timeline
from ..spec.topology import Topology

Key = tuple  # ("act" | "grad" | "eval" | "weight" | "wgrad", tensor, micro-batch | version | step)
GRADIENTS = ("grad", "wgrad")


@dataclass(frozen=True)
class StepEvent:
    step: int
    stages: tuple[int, ...]  # this rank's stages that take their optimizer step here
    ranks: tuple[int, ...]  # ranks meeting here in collectives (the gradient norm)
    barrier: tuple  # the same value on every rank of `ranks`


@dataclass(frozen=True)
class Planned:
    """One action of a rank, with what it implies."""

    action: Action
    sends: tuple[tuple[int, Key], ...] = ()  # (destination rank, key), in sending order
    event: StepEvent | None = None  # the optimizer step applied here
    ends_step: int | None = None  # the rank's last action of this step: a step window ends

    def sends_grad(self, tensor: str) -> bool:
        return any(key[0] in GRADIENTS and key[1] == tensor for _, key in self.sends)


class KeyStream:
    """The keys one rank sends another, in order, made as they are asked for; each is asked
    for in increasing position (a sender's sends, a receiver's posts), so older ones go."""

    def __init__(self, keys: Iterator[Key]):
        self._keys, self._buf, self._base = keys, deque(), 0

    def get(self, i: int) -> Key | None:
        while self._base < i and self._buf:
            self._buf.popleft()
            self._base += 1
        while self._base + len(self._buf) <= i:
            key = next(self._keys, None)
            if key is None:
                return None
            self._buf.append(key)
        return self._buf[i - self._base]


class Dataflow:
    def __init__(self, topo: Topology, timeline: Timeline, evaluation=None):
        self.topo, self.timeline, self.evaluation = topo, timeline, evaluation
        self.micro_batches = timeline.m
        self.synchronous = timeline.schedule.synchronous
        self.policies = timeline.schedule.policies(topo.stage_infos(), timeline.m)
        self._versions: dict[str, ForwardVersions] = {}  # weight -> its owner's forwards

    def shared(self, tensor: str) -> bool:
        """Is `tensor` a weight, sent once per version and its gradient once per step?"""
        return self.topo.transfers[tensor].weight

    def version(self, tensor: str, mb: int) -> int:
        """The version of weight `tensor` that micro-batch `mb` reads (its owner's forward's)."""
        versions = self._versions.get(tensor)
        if versions is None:
            owner = self.topo.transfers[tensor].producer
            versions = self._versions[tensor] = ForwardVersions(
                self.listed(self.topo.rank_of[owner]),
                owner,
                self.policies[owner],
                self.micro_batches,
                self.timeline.first,
            )
        return versions.version(mb)

    def weight_key(self, tensor: str, mb: int) -> Key:
        """The message carrying the version of weight `tensor` that micro-batch `mb` reads."""
        return ("weight", tensor, self.version(tensor, mb))

    def eval_reads(self, tensor: str, j: int) -> int | None:
        """The training micro-batch whose version of weight `tensor` evaluation batch j's
        readers on other ranks read, or None: the round sends its own copy. The round's value
        is the owner's weights just before its forward of the next micro-batch (its round
        sits there), which is the version that forward sends. Where the readers' last forward
        read that version too (FTPipe's versions straddle the step a round follows), they
        hold it through the round, so they read it and no copy crosses: the copy would be one
        more weight-sized buffer on the owner and on each reader, which the plan's memory
        does not count. Never at the last round, after everything."""
        if self.evaluation is None or not self.shared(tensor):
            return None
        mb = self.evaluation.after(j)
        if mb is None or mb - 1 < self.timeline.first * self.micro_batches:
            return None
        return mb if self.version(tensor, mb) == self.version(tensor, mb - 1) else None

    def slot(self, tensor: str, mb: int) -> tuple[str, int]:
        """What the value of `tensor` micro-batch `mb` reads is kept under: (tensor, mb), or for
        a weight (tensor, -1 - version) (never a micro-batch's number)."""
        return (tensor, -1 - self.version(tensor, mb)) if self.shared(tensor) else (tensor, mb)

    def grad_slot(self, tensor: str, mb: int) -> tuple[str, int]:
        """What the gradient of `tensor` from micro-batch `mb` is summed under: (tensor, mb), or
        for a weight (tensor, -1 - step)."""
        return (tensor, -1 - mb // self.micro_batches) if self.shared(tensor) else (tensor, mb)

    def uses(self, tensor: str, rank: int, mb: int) -> int:
        """How many forwards on `rank` read the value of `tensor` micro-batch `mb` reads (one
        per local reader, times the micro-batches reading that version for a weight)."""
        n = len(self.topo.local_consumers(tensor, rank))
        if not self.shared(tensor) or not n:
            return n
        v = self.version(tensor, mb)
        return n * self._versions[tensor].forwards(v)

    def grad_uses(self, tensor: str, rank: int) -> int:
        """How many backwards on `rank` add to one gradient of `tensor` sent back."""
        n = len(self.topo.local_consumers(tensor, rank))
        return n * self.micro_batches if self.shared(tensor) else n

    def sending_order(self, stage: int) -> list[str]:
        """A forward's outputs in the order it sends them: activations first (the next
        stage's forward can start on them), then weights (once per version)."""
        return sorted(self.topo.outputs[stage], key=self.shared)

    def grad_order(self, stage: int) -> list[str]:
        """A backward's inputs in the order it sends their gradients: activations' first
        (the producer's backward waits on them), then weights' (summed over the step, taken
        at the end of the owner's last backward); a 51 MB weight gradient sent first would
        hold the activation's up on the link, and with it the owner's whole backward."""
        return sorted(self.topo.inputs[stage], key=self.shared)

    def actions(self, rank: int) -> Iterator[Planned]:
        """Every action of `rank` in order, with its messages and its optimizer step."""
        topo, sync = self.topo, self.timeline.schedule.synchronous
        local = tuple(topo.stages_on(rank))
        readers: dict[tuple[str, int], int] = {}  # slot -> local readers' backwards left
        steps: dict[int, int] = {}  # step -> this rank's S actions of it so far
        sent: dict[str, int] = {}  # weight -> the last version sent
        for a in self.listed(rank):
            if a.kind == "E":  # a weight once per round (`evaluate.Rounds.key`), or none
                out = [
                    (dst, key)
                    for t in topo.outputs[a.stage]
                    if (key := self.evaluation.key(t, a.mb)) is not None
                    and self.eval_reads(t, a.mb) is None
                    for dst in topo.remote_ranks(t)
                ]
                yield Planned(a, tuple(out))
            elif a.kind == "F":
                out = []
                for t in self.sending_order(a.stage):
                    key = ("act", t, a.mb)
                    if self.shared(t):
                        v = self.version(t, a.mb)
                        if sent.get(t) == v:
                            continue
                        sent[t], key = v, ("weight", t, v)
                    out += [(dst, key) for dst in topo.remote_ranks(t)]
                yield Planned(a, tuple(out))
            elif a.kind == "B":
                out = []
                for t in self.grad_order(a.stage):
                    tr = topo.transfers[t]
                    src = topo.rank_of[tr.producer]
                    if not tr.grad or src == rank:
                        continue
                    slot = self.grad_slot(t, a.mb)
                    left = readers.pop(slot, self.grad_uses(t, rank)) - 1
                    if left:
                        readers[slot] = left
                    elif self.shared(t):
                        out.append((src, ("wgrad", t, a.mb // self.micro_batches)))
                    else:
                        out.append((src, ("grad", t, a.mb)))
                yield Planned(a, tuple(out))
            elif a.kind == "W":  # weight gradients: nothing sent (GradSync all-reduces them)
                yield Planned(a)
            else:
                steps[a.mb] = done = steps.get(a.mb, 0) + 1
                last = done == len(local)
                if last:
                    del steps[a.mb]
                out = []
                if not sync:
                    event = StepEvent(a.mb, (a.stage,), (rank,), ("stage", (a.stage,), a.mb))
                elif last:
                    event = StepEvent(a.mb, local, tuple(range(topo.world)), ("step", a.mb))
                    for t, v in self._made_by_step(local, a.mb):
                        sent[t] = v
                        out += [(dst, ("weight", t, v)) for dst in topo.remote_ranks(t)]
                else:
                    event = None
                yield Planned(a, tuple(out), event, a.mb if last else None)

    def _made_by_step(self, stages, step: int) -> list[tuple[str, int]]:
        """(weight, version) of the weights of `stages` that other ranks read, as the
        synchronous step `step` leaves them, read from the next step's first micro-batch on:
        sent at once, so the transfer overlaps the owner's next forward instead of following
        it. The run's last step makes nothing anybody reads."""
        if step + 1 >= self.timeline.steps:
            return []
        first_mb = (step + 1) * self.micro_batches
        return [
            (t, self.version(t, first_mb))
            for s in stages
            for t in self.sending_order(s)
            if self.shared(t) and self.topo.remote_ranks(t)
        ]

    def listed(self, rank: int) -> Iterator[Action]:
        """The rank's actions alone: the schedule's, with the evaluation rounds spliced in."""
        acts = self.timeline.actions(rank)
        if self.evaluation is not None:  # evaluate.Rounds: (rank, actions) -> with rounds
            acts = self.evaluation(rank, acts)
        return acts

    def keys(self, src: int, dst: int) -> KeyStream:
        """What `src` sends `dst`, in its sending order."""
        made = (key for item in self.actions(src) for to, key in item.sends if to == dst)
        return KeyStream(made)

    def peers(self) -> list[tuple[int, int]]:
        """(sender, receiver) pairs with messages: activations down, gradients back up."""
        pairs = set()
        for t in self.topo.transfers.values():
            src = self.topo.rank_of[t.producer]
            for dst in self.topo.remote_ranks(t.name):
                pairs.add((src, dst))
                if t.grad:
                    pairs.add((dst, src))
        return sorted(pairs)
