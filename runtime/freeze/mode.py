"""How a run trains beyond plain fine-tuning: the one object the run consults for freeze
training (PipeTransformer §3.1, `freezing.py`) and the shorter plans it switches to
(§3.2-3.3, `elastic.py`). Frozen parameters and LoRA need nothing here: they are in the
plan (`Param.frozen`) and the stages (`frozen.py`).

    mode = TrainingMode.of(config, Shrinks.beside(plan_path))
    end = mode.segment_end(first, steps, gpus)      # where this plan's segment ends
    freezer = mode.freezer(plan, modules, ...)       # None without freeze training
    carried = mode.switch(settled, prepared, ...)    # at a segment's end: the next plan

A run with freeze training is cut into segments at its freeze decisions while a shorter
pipeline is left; each segment's row (steps, shape, speed) goes into the summary.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ..errors import PipelineConfigError
from .elastic import Carried, Shrinks, hand_over, segment_end
from .layers import FreezeTraining

if TYPE_CHECKING:
    from ..job.context import Prepared, Settled

__all__ = ["TrainingMode", "segment_line"]


@dataclass(frozen=True)
class TrainingMode:
    alpha: float | None = None  # --freeze-alpha: eq. 1's alpha (None: no rule)
    every: int = 1  # --freeze-every: optimizer steps between decisions
    forced: tuple = ()  # --freeze-at: (step, layers) decisions
    shrinks: Shrinks | None = None  # the shorter plans beside the package's (elastic/)
    decisions: list = field(default_factory=list, compare=False)  # across the run's plans

    @classmethod
    def of(cls, config, shrinks: Shrinks | None = None) -> TrainingMode:
        mode = cls(config.freeze_alpha, config.freeze_every, tuple(config.freeze_at))
        return mode if not mode.freezing else cls(mode.alpha, mode.every, mode.forced, shrinks)

    @property
    def freezing(self) -> bool:
        return self.alpha is not None or bool(self.forced)

    def decides(self, k: int) -> bool:
        """Is a freeze decision taken after step k (0-based)? (`FreezeTraining.due`)"""
        forced = {s for s, _ in self.forced}
        return k + 1 in forced or (self.alpha is not None and (k + 1) % self.every == 0)

    def segment_end(self, first: int, steps: int, gpus: int) -> int:
        pending = bool(self.shrinks and self.shrinks.pending(gpus))
        return segment_end(first, steps, self.decides, pending)

    def check(self, schedule, name: str, *, shrinking: bool, config, evaluating: bool) -> None:
        """What freeze training cannot run with yet, refused before any rank waits."""
        if shrinking and (evaluating or config.save_hf or config.trace):
            raise PipelineConfigError(
                "evaluation, --save-hf and --trace do not run with a pipeline that shrinks yet "
                "(elastic/ beside the plan); leave them out, or compile without --freeze-training"
            )
        if self.freezing and not schedule.synchronous:
            raise PipelineConfigError(
                f"freeze training needs a synchronous schedule, not {name}; pick gpipe or 1f1b"
            )

    def freezer(self, plan, modules, optimizers, mixed, comm, *, resume: bool, say, runlog):
        """Freeze training's part on this rank (None: off); its decisions are said (`say`),
        recorded in the run log and kept for the summary (`decisions`)."""
        if not self.freezing:
            return None
        if resume:
            raise PipelineConfigError(
                "freeze training does not resume from a checkpoint yet; start the run again"
            )

        def record(row):
            self.decisions.append({k: v for k, v in row.items() if k != "norms"})
            if row["frozen"] > row["before"]:
                say(
                    f"step {row['step']}: {row['frozen']} of {row['layers']} layers frozen "
                    f"({row['by']}; bound {row['bound']})"
                )
            if runlog is not None:
                runlog.record("freeze", **row)

        try:
            return FreezeTraining(plan, modules, optimizers, mixed, comm, alpha=self.alpha,
                                  every=self.every, forced=dict(self.forced),
                                  record=record)  # fmt: skip
        except ValueError as e:
            raise PipelineConfigError(str(e)) from None

    def switch(
        self, settled: Settled, prepared: Prepared, *, freezer: FreezeTraining, first: int,
        losses: dict, note, end: int, segments: list,
    ) -> Carried:  # fmt: skip
        """At a segment's end (step `end`; it started at `first`): hand everything over to the
        next plan (or the same one, when the decision did not freeze enough for a shorter
        pipeline), with the losses so far; `note` tells rank 0's log of a switch."""
        place, carried, m = settled.place, settled.carried, settled.micro_batches
        reps = place.reps
        nxt = self.shrinks.after(freezer.frozen, reps.gpus, reps.count, m)
        if nxt is None:
            name, new_plan, stages, new_m = (
                carried.name if carried else "",
                settled.plan,
                settled.stage_classes,
                m,
            )
        else:
            new_plan, stages = self.shrinks.load(nxt)
            name, new_m = nxt.name, m * reps.count // nxt.replicas
            note(
                f"step {end}: {freezer.frozen} layers frozen: switching to {nxt.replicas} "
                f"replicas x {nxt.gpus} GPUs ({nxt.name})"
            )
        # Only what each rank's stages in the next plan need, point to point.
        tensors, opt, received = hand_over(
            prepared.modules, prepared.optimizers, prepared.mixed, new_plan, place
        )
        segments[-1]["handed_over_bytes"] = received  # per rank: what it received at the switch
        return Carried(
            first=end, start=carried.start if carried else first, name=name, plan=new_plan,
            stages=stages, micro_batches=new_m, frozen=freezer.frozen, tensors=tensors,
            optimizer=opt, losses=dict(losses), runlog=prepared.runlog, segments=segments,
        )  # fmt: skip


def segment_row(first: int, end: int, reps, samples: int, wall: float, ends: dict) -> dict:
    """The summary's row for the steps first..end-1 trained on one plan. `ends`: step ->
    seconds from the segment's start to the end of the step's forwards on the loss stage
    (rank 0 hears them with the losses; benchmarks time steps by them)."""
    speed = (end - first) * samples / wall if wall > 0 else 0.0
    return {"steps": [first, end], "replicas": reps.count, "gpus": reps.gpus,
            "wall_s": wall, "samples_per_s": speed,
            "step_ends_s": [ends[k] for k in sorted(ends)]}  # fmt: skip


def segment_line(row: dict) -> str:
    a, b = row["steps"]
    return (
        f"steps {a + 1}-{b} on {row['replicas']} replicas x {row['gpus']} GPUs: "
        f"{row['samples_per_s']:.1f} samples/s"
    )
