"""The step's loss as the HuggingFace Trainer has it: the sum over the step's label tokens
divided by their number, across every micro-batch and replica of the step.

    weights = LossWeights(data, micro_batches=4)   # data: the run's (a Shard with replicas)
    grad_w, loss_w = weights.of(mb)                # this rank's micro-batch mb
    (loss_mb * grad_w).backward()                  # loss_mb: the stage's mean over its tokens
    step_loss = sum(loss_mb * loss_w for the step's micro-batches of every replica)

A stage's loss is the mean over its micro-batch's counted tokens (`Head.loss_items`: labels
not -100, after a causal LM's shift; samples for a per-sample head), so scaling it by
n_mb / N_step turns it into that micro-batch's share of the step's token sum: the gradient
of a step is the same whatever micro-batches it is cut into (a mean of per-micro-batch means
weighs a short micro-batch's tokens more: the gradient-accumulation bug transformers fixed in
4.46). The count of the whole step is known before the step: every rank reads the same data,
so the loss rank counts every replica's micro-batches itself (no collective). Replicas average
their gradients (`GradSync` divides by their number), so a replica's gradient weight carries
that number back: the replicas' mean is then the whole batch's token-weighted gradient.
A model with no known head weighs its micro-batches equally (the mean of their means).
"""

from __future__ import annotations

from .replicas import Shard

__all__ = ["LossWeights", "loss_items"]


def loss_items(data, mb: int) -> int:
    """The items micro-batch `mb` of `data` averages its loss over (1: no known head)."""
    head = getattr(data, "head", None)
    if head is None:
        return 1
    read = getattr(data, "peek", data.get)  # uncached where the source can (`_Inputs.peek`)
    return head.loss_items(read(head.labels[0], mb))


class LossWeights:
    """Each micro-batch's weights in its step's loss; see the module doc."""

    def __init__(self, data, micro_batches: int):
        self.m = micro_batches
        if isinstance(data, Shard):
            self.whole, self.replicas, self.global_mb = data.data, data.replicas, data.global_mb
        else:
            self.whole, self.replicas, self.global_mb = data, 1, (lambda mb: mb)
        self.totals: dict[int, int] = {}  # step -> its label tokens, every replica's

    def total(self, step: int) -> int:
        if step not in self.totals:
            per_step = self.replicas * self.m
            first = step * per_step
            self.totals[step] = sum(
                loss_items(self.whole, g) for g in range(first, first + per_step)
            )
            for old in [k for k in self.totals if k < step - 2]:  # steps long done
                del self.totals[old]
        return self.totals[step]

    def of(self, mb: int) -> tuple[float, float]:
        """(gradient weight, loss weight) of this replica's micro-batch `mb`: its share of
        the step's tokens, times the replicas for the gradient (they are averaged). Both 0
        for a micro-batch with nothing to predict (its mean loss is 0/0: left out)."""
        n = loss_items(self.whole, self.global_mb(mb))
        total = self.total(mb // self.m)
        if n == 0 or total == 0:
            return 0.0, 0.0
        return n * self.replicas / total, n / total
