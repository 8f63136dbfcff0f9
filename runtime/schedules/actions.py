"""Actions and the registry of action kinds that the executor, validator and simulator share.

    Action.parse("3F2")     # stage 3 forwards micro-batch 2
    Action.parse("3R2")     # its backward, recomputing the forward first ("B" with recompute)
    Action.parse("3W2")     # its weight gradients (when the schedule splits the backward)
    Action.parse("3S1")     # its optimizer step number 1
    Action.parse("3E4")     # its forward of evaluation batch 4 (no gradient, nothing kept)
    str(Action("B", 3, 2))  # "3B2"

A kind says which earlier actions an action of that kind waits for, as data: `needs` lists
(kind, relation) pairs, where the relation names the stages of the same micro-batch that
must have run that kind first ("self", "producers": stages it receives from, "consumers":
stages it sends to). The validator executes lists with these rules; the executor and the
simulator each keep one handler per kind letter. A new kind is one more `Kind` here and one
handler in each of them.

Zero-bubble schedules split a backward in two (`StagePolicy.split`): B computes the input
gradients only (what upstream stages wait for) and W, later, the weight gradients. W is
`optional`: a stage has one per micro-batch exactly when its schedule splits its backward.
"""

from __future__ import annotations

import re
from dataclasses import dataclass


@dataclass(frozen=True)
class Kind:
    letter: str
    meaning: str
    needs: tuple[tuple[str, str], ...]  # (kind, relation) of the same micro-batch, done first
    holds: int  # +1: the stage keeps the micro-batch's activations from here; -1: frees them
    per_micro_batch: bool  # False: `mb` counts optimizer steps, not micro-batches
    # False: not part of a training schedule (evaluation): `mb` numbers its own inputs, and
    # only the deadlock check applies to it; a schedule never makes one, the run adds them.
    trains: bool = True
    optional: bool = False  # required only when the stage's schedule splits its backward


KINDS: dict[str, Kind] = {
    "F": Kind("F", "forward", (("F", "producers"),), +1, True),
    # A split B frees nothing: the graph its W needs stays until that W.
    "B": Kind("B", "backward", (("F", "self"), ("B", "consumers")), -1, True),
    "W": Kind("W", "weight-gradient pass", (("B", "self"),), -1, True, optional=True),
    "S": Kind("S", "optimizer step", (), 0, False),
    # A forward of evaluation batch mb, nothing kept (`ftpipe_runtime.engine.evaluate`); not timed
    # by the simulator, which plans training only.
    "E": Kind("E", "evaluation forward", (("E", "producers"),), 0, True, trains=False),
}
RECOMPUTE = "R"  # printed for a backward that recomputes its forward first
_ACTION = re.compile(r"(\d+)([A-Z])(\d+)")


@dataclass(frozen=True)
class Action:
    kind: str  # a letter of KINDS
    stage: int
    mb: int  # global micro-batch; for a kind that is not per micro-batch, the step number
    recompute: bool = False  # B only: recompute the forward from the saved stage inputs first

    def __post_init__(self):
        if self.kind not in KINDS or (self.recompute and self.kind != "B"):
            raise ValueError(f"bad action {self.kind!r} (recompute={self.recompute})")

    def __str__(self) -> str:
        return f"{self.stage}{RECOMPUTE if self.recompute else self.kind}{self.mb}"

    @property
    def spec(self) -> Kind:
        return KINDS[self.kind]

    @classmethod
    def parse(cls, text: str) -> Action:
        """`Action.parse("3R2")` -> Action("B", 3, 2, recompute=True)."""
        m = _ACTION.fullmatch(text.strip())
        letters = {*KINDS, RECOMPUTE}
        if not m or m.group(2) not in letters:
            examples = ", ".join(f"3{k}2" for k in (*KINDS, RECOMPUTE))
            raise ValueError(f"not an action: {text!r}; write e.g. {examples}")
        stage, letter, mb = m.groups()
        kind = "B" if letter == RECOMPUTE else letter
        return cls(kind, int(stage), int(mb), letter == RECOMPUTE)
