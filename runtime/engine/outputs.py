"""Stage outputs on their way to their consumers: kept on this rank until their last local
use, sent once to every other rank that reads them, received where they are taken.

    acts = Outputs(topo, rank, comm, "act", flow)   # training forwards (weights per version)
    evals = Outputs(topo, rank, comm, "eval", RoundWeights(topo, batches=16, synchronous=True))
    acts.put("hidden_3", mb, tensor); acts.take("hidden_3", mb)
"""

from __future__ import annotations

import torch

__all__ = ["Outputs"]


class Outputs:
    """Stage outputs of one kind of forward ("act": training, "eval": evaluation), by (tensor,
    micro-batch): kept for this rank's consumers until their last use, and sent once to
    every other rank that consumes them. With `flow`, a weight is kept and sent once for all
    the forwards that read the same value of it, under `flow.slot` and `flow.weight_key`
    (training: `Dataflow`, once per version; evaluation: `evaluate.RoundWeights`, once per
    round); `flow.synchronous` says whether the owner's next step waits for every reader."""

    def __init__(self, topo, rank: int, comm, kind: str, flow=None):
        self.topo, self.rank, self.comm, self.kind, self.flow = topo, rank, comm, kind, flow
        self.held: dict[tuple[str, int], list] = {}  # slot -> [value, uses left]
        self.put_last: dict[str, tuple] = {}  # tensor -> the slot it was last put under

    def _slot(self, t: str, m: int) -> tuple[tuple, tuple, int]:
        """(slot, message key, uses on this rank) of tensor t's value for micro-batch m."""
        flow = self.flow
        if flow is not None and flow.shared(t):
            return flow.slot(t, m), flow.weight_key(t, m), flow.uses(t, self.rank, m)
        return (t, m), (self.kind, t, m), len(self.topo.local_consumers(t, self.rank))

    def put(self, t: str, m: int, value: torch.Tensor) -> None:
        slot, key, uses = self._slot(t, m)
        if self.put_last.get(t) == slot:  # a weight already sent in this version
            return
        self.put_last[t] = slot
        remote = self.topo.remote_ranks(t) if key is not None else ()  # None: nothing sent
        if not (uses or remote):
            return
        value = value.detach()
        if self.topo.transfers[t].weight and not self._settled():
            value = value.clone()  # the parameter itself: a step could change it meanwhile
        if uses:
            self.held[slot] = [value, uses]
        for dst in remote:
            self.comm.send(dst, key, value)

    def _settled(self) -> bool:
        """Is every use of a weight sent now over before its owner steps again? Under a
        synchronous schedule yes: the owner's next step comes after its last backward of
        the step, which waits for every reader's gradient, so every reader has received
        the weight and run its forwards by then (no copy needed for the messages or the
        local readers). Otherwise a reader may run after the owner's step: send a copy."""
        return self.flow is not None and self.flow.synchronous

    def take(self, t: str, m: int) -> torch.Tensor:
        slot, entry = self._entry(t, m)
        entry[1] -= 1
        if entry[1] == 0:
            del self.held[slot]
        return entry[0]

    def peek(self, t: str, m: int) -> torch.Tensor:
        """The value of t micro-batch m reads, as `take` gives it, its uses left as they are
        (an evaluation reading the weight version the next forward reads)."""
        return self._entry(t, m)[1][0]

    def _entry(self, t: str, m: int) -> tuple[tuple, list]:
        slot, key, uses = self._slot(t, m)
        entry = self.held.get(slot)
        if entry is None:
            src = self.topo.rank_of[self.topo.transfers[t].producer]
            value = self.comm.recv(src, key)
            entry = self.held[slot] = [value, uses]
        return slot, entry
