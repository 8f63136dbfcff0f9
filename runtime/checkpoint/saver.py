"""The step hook that checkpoints: every `every` steps and after the last one, each stage
once its step is taken (an asynchronous schedule steps its stages at different times), then
the rank's manifest once all of its stages are saved. A save that fails (a full disk) gives
the step up (`Checkpoints.abandon`: no checkpoint, each rank's part removed as it leaves)
and stops the run in one sentence; the checkpoints before it are intact.
A stage with sharded optimizer state (`train.zero`) is gathered first, by every replica
together, and written whole by the first: the files are those of an unsharded run.

    saver = Saver(ckpt, every=10, steps=100, micro_batches=8)
    saver.modules, saver.optimizers, saver.precision = modules, optimizers, mixed
    stepper = Stepper(..., on_stepped=saver)
"""

from __future__ import annotations

from ..errors import WriteFailed
from .store import Checkpoints

__all__ = ["Saver"]


class Saver:
    """The step hook that checkpoints every `every` steps and after the last one."""

    def __init__(
        self, ckpt: Checkpoints, every: int, steps: int, micro_batches: int, stages: bool = True
    ):
        self.ckpt, self.every, self.steps, self.m = ckpt, every, steps, micro_batches
        self.stages = stages  # False: a replica other than the first; its stages are the same
        self.modules: dict = {}
        self.optimizers: dict = {}
        self.precision = None  # a MixedPrecision: its fp32 masters are the weights saved
        self.versions = lambda stage, step: {}  # kept weight versions a resume at step needs
        self.drained = False  # whether the schedule drains its pipeline at checkpoints
        self._saved: dict[int, set] = {}  # step -> stages saved (asynchronous: one at a time)

    def __call__(self, event, step: int) -> None:
        done = step + 1
        if done % self.every and done != self.steps:
            return
        try:
            self._save(event, done)
        except WriteFailed as e:
            self.ckpt.abandon(done)
            raise WriteFailed(
                f"{e}; the checkpoint of step {done} is removed and the ones before it are "
                "intact (--resume continues from the newest)"
            ) from e.__cause__

    def _save(self, event, done: int) -> None:
        for s in event.stages:
            mixed, module, optimizer = self.precision, self.modules[s], self.optimizers[s]
            if mixed is not None:  # an overlapped CPU step: done before its state is read
                mixed.finish(s)
            whole = optimizer.gather() if s in getattr(mixed, "shards", {}) else None
            if not self.stages:  # (a sharded stage's replicas took part in the gather)
                continue
            tensors = mixed.state_dict(s, module) if mixed is not None else None
            if whole is not None:  # the masters and the state put together
                tensors, optimizer = {**tensors, **whole.masters}, whole
            self.ckpt.save_stage(done, s, module, optimizer, tensors)
        self._saved.setdefault(done, set()).update(event.stages)
        if self._saved[done] == set(self.modules):
            scale = getattr(self.precision, "loss_scale", None)
            state = {"loss_scale": scale.to_json()} if scale is not None else None
            kept = {s: self.versions(s, done) for s in self.modules}
            self.ckpt.finish_rank(done, done * self.m, self.steps, state, kept, self.drained)
            del self._saved[done]
