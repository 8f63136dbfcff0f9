"""Evaluation through the pipeline: forward-only actions spliced into the training lists.

    points = eval_points(steps=40, first=0, every=5)          # after steps 5, 10, ..., 40
    acts = with_evaluation(acts, stages, micro_batches, points, batches, first=0)  # one GPU's
    rounds = splicer(topo, m, eval_data, steps=40, first=0, every=5)  # Rounds, or None
    rounds(gpu, acts); rounds.key("add_7", 3)                  # one GPU's, with its rounds
    evaluator = Evaluator(topo, rank, modules, comm, eval_data, device, tag_base=steps)
    executor.handlers["E"] = evaluator.forward                 # the handler of kind E
    loss_messages(loss_rank_actions, topo.loss_stage, m, n)    # what rank 0 receives, in order
    listener = listen_for_losses(run)                          # rank 0: those, in a thread

Actions stream by (`schedules.Timeline`), so rounds are spliced into one GPU's actions as
they pass, and the messages rank 0 receives are made as they are needed; micro-batches are
the run's own numbers (a run resumed at step k starts at micro-batch k * m).

An evaluation round is one `E` action (`schedules.KINDS`) per stage and evaluation batch:
a forward in eval mode (dropout off), under no_grad, that keeps nothing and sends its
outputs on as ("eval", tensor, batch) messages; a weight read by other stages (a tied
embedding) goes once per round, as training sends it once per version: the message of the
round's first batch, kept by its readers for all of the round's batches; or not at all where
its readers hold that value already, for their next forward (`Dataflow.eval_reads`). On
every GPU the round after step k sits just before the stage's first forward of step k + 1,
so an evaluation needs exactly what that forward needs and the lists stay deadlock-free (the
validator checks them all the same); under a synchronous schedule every stage has then taken
step k, under an asynchronous one each stage evaluates the weights it holds at that point (a
stage that forwards ahead may not have applied step k yet), as it trains. The last round
comes after everything. The loss stage adds up each batch's loss weighted by its label tokens
(`train.loss_weights.loss_items`: samples for a per-sample head) and sends rank 0 [sum,
tokens, samples, seconds]: the token-weighted mean loss of the evaluation set, whatever its
batch size (as the training loss). With data-parallel replicas, rank 0's pipeline alone
evaluates (they hold the same weights; `listen_for_losses` hears its loss stage).
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable, Iterator
from functools import partial

import torch

from ..schedules import Action
from ..train.loss_weights import loss_items
from ..train.replicas import LossGather
from .outputs import Outputs

__all__ = [
    "Evaluator",
    "RoundWeights",
    "Rounds",
    "eval_points",
    "listen_for_losses",
    "loss_messages",
    "perplexity",
    "reporter",
    "splicer",
    "with_evaluation",
]

LM_HEADS = ("causal-lm", "seq2seq-lm", "masked-lm")


def eval_points(steps: int, first: int, every: int) -> list[int]:
    """Steps of this run (counted from 0 at `first`) after which to evaluate: every `every`
    steps of the whole run (0: none), and the last."""
    local = steps - first
    points = [k for k in range(local - 1) if every and (first + k + 1) % every == 0]
    return [*points, local - 1]


def with_evaluation(
    acts: Iterable[Action],
    stages: list[int],
    micro_batches: int,
    points: list[int],
    batches: int,
    first: int = 0,
) -> Iterator[Action]:
    """One GPU's actions (of `stages`, a run from step `first`) with an evaluation round
    (batches 0..batches-1 of every stage) after each of `points`; round r's actions number
    its batches r * batches + j."""
    *middle, _ = points
    before = {(first + k + 1) * micro_batches: r for r, k in enumerate(middle)}  # step k + 1
    for a in acts:
        if a.kind == "F" and a.mb in before:
            yield from _round(a.stage, before[a.mb], batches)
        yield a
    for s in stages:  # the last round, after everything
        yield from _round(s, len(middle), batches)


def splicer(topo, micro_batches: int, data, steps: int, first: int, every: int):
    """The run's evaluation `Rounds`; None without an evaluation set."""
    if data is None:
        return None
    points = eval_points(steps, first, every)
    return Rounds(topo, micro_batches, data.micro_batches, points, first)


class Rounds:
    """A run's evaluation rounds: `rounds(gpu, acts)` is one GPU's actions with them spliced
    in (`with_evaluation`), `rounds.key(t, j)` the message of output t that evaluation batch
    j sends (None: none)."""

    def __init__(self, topo, micro_batches: int, batches: int, points: list[int], first: int):
        self.topo, self.m, self.batches = topo, micro_batches, batches
        self.points, self.first = points, first

    def __call__(self, gpu: int, acts: Iterable[Action]) -> Iterator[Action]:
        stages = self.topo.stages_on(gpu)
        return with_evaluation(acts, stages, self.m, self.points, self.batches, self.first)

    def key(self, t: str, j: int) -> tuple | None:
        """An activation every batch; a weight once per round, with its first batch (none
        where its readers hold its value already: `Dataflow.eval_reads`)."""
        if self.topo.transfers[t].weight and _round_start(j, self.batches) != j:
            return None
        return ("eval", t, j)

    def after(self, j: int) -> int | None:
        """The first training micro-batch after evaluation batch j's round (None: the last
        round, after everything)."""
        r = j // self.batches
        if r >= len(self.points) - 1:
            return None
        return (self.first + self.points[r] + 1) * self.m


class RoundWeights:
    """What `Outputs` asks a flow about weights, for evaluation: a weight read by other
    stages is one value for a whole round (its owner steps between rounds, never inside
    one), kept under (tensor, -1 - round) for every batch of the round on each local reader
    and sent with the round's first batch (`Rounds.key`). Under a synchronous schedule the
    owner's next step waits for every reader's round (it needs their gradients of the step
    after it), so the parameter itself goes; otherwise a copy (`Outputs._settled`)."""

    def __init__(self, topo, batches: int, synchronous: bool, flow=None):
        self.topo, self.batches, self.synchronous = topo, batches, synchronous
        self.flow = flow  # the run's `Dataflow`: where the readers hold the value already

    def shared(self, t: str) -> bool:
        return self.topo.transfers[t].weight

    def slot(self, t: str, j: int) -> tuple[str, int]:
        return (t, -1 - j // self.batches)

    def weight_key(self, t: str, j: int) -> tuple | None:
        """The round's message of weight t; None where its readers on other ranks hold its
        value already, for their next forward (`Dataflow.eval_reads`): nothing is sent."""
        if self.flow is not None and self.flow.eval_reads(t, j) is not None:
            return None
        return ("eval", t, _round_start(j, self.batches))

    def uses(self, t: str, rank: int, j: int) -> int:
        return len(self.topo.local_consumers(t, rank)) * self.batches


def _round_start(j: int, batches: int) -> int:
    """The first batch of evaluation batch j's round (the one that carries its weights)."""
    return j - j % batches


def reporter(plan: dict, steps: int, first: int, every: int, progress):
    """Rank 0's callback for round r's [weighted loss, tokens, samples, seconds]:
    `progress.evaluated`."""
    points = eval_points(steps, first, every)
    head = plan.get("model", {}).get("head", "")

    def on_eval(r: int, message) -> None:
        total, tokens, samples, _ = (float(x) for x in message)
        loss = total / tokens if tokens else math.nan
        progress.evaluated(first + points[r] + 1, loss, perplexity(head, loss), int(samples))

    return on_eval


def _round(stage: int, r: int, batches: int) -> list[Action]:
    return [Action("E", stage, r * batches + j) for j in range(batches)]


def loss_messages(
    acts: Iterable[Action], loss_stage: int, micro_batches: int, batches: int
) -> Iterator[tuple]:
    """("loss", step) and ("eval", round) in the order the loss stage's rank sends them."""
    counts: dict[tuple[str, int], int] = {}
    for a in acts:
        if a.stage != loss_stage or a.kind not in ("F", "E"):
            continue
        key = ("loss", a.mb // micro_batches) if a.kind == "F" else ("eval", a.mb // batches)
        counts[key] = counts.get(key, 0) + 1
        if counts[key] == (micro_batches if a.kind == "F" else batches):
            del counts[key]
            yield key


def listen_for_losses(
    topo, flow, comm, *, micro_batches: int, reps, executor, on_loss, on_eval, evals, steps: int
):
    """Rank 0's thread receiving the losses (and evaluation results) of the loss stage's
    ranks, or None when rank 0 holds the only loss stage. `on_loss(step, message)` and
    `on_eval(step, message)` take them (the progress's, `reporter`'s); with replicas,
    `executor.on_loss` gathers rank 0's own with the others'. `evals`: the evaluation data
    (None: none), `steps`: the run's."""
    m, loss_rank = micro_batches, topo.rank_of[topo.loss_stage]
    n = evals.micro_batches if evals is not None else 1
    if reps.count > 1:  # every replica's losses, one step's together
        heads = [reps.rank(r, loss_rank) for r in range(reps.count)]
        gather = LossGather(heads, on_loss)
        executor.on_loss = lambda k, msg: gather.add(k, 0, msg)
        take_loss = gather.add  # (step, source, message)
        # the evaluation's results: from rank 0's replica alone (`RunJob.settle`)
        judge = reps.rank(reps.where(0)[0], loss_rank)
    elif loss_rank == 0:
        return None
    else:
        heads, judge = [loss_rank], loss_rank
        take_loss = lambda k, _, msg: on_loss(k, msg)  # noqa: E731

    def expected(kind: str, k: int) -> list:
        if kind == "eval":
            return [] if judge == 0 else [(judge, steps + k, 4, partial(on_eval, k))]
        return [(src, k, m + 1, partial(take_loss, k, src)) for src in heads if src != 0]

    messages = (  # made as the listener needs them, from the loss rank's actions
        message
        for kind, k in loss_messages(flow.listed(loss_rank), topo.loss_stage, m, n)
        for message in expected(kind, k)
    )
    return comm.listen_losses(messages)


def perplexity(head: str, loss: float) -> float | None:
    """exp(mean loss) for language models (None otherwise; inf past exp's range)."""
    if head not in LM_HEADS:
        return None
    return math.exp(loss) if loss < 700 else math.inf


class Evaluator:
    """The E handler of one rank: forward-only, nothing kept, the loss stage sums."""

    def __init__(
        self,
        topo,
        rank,
        modules,
        comm,
        data,
        device,
        tag_base: int,
        on_result=None,
        synchronous: bool = False,
        flow=None,
        training: Outputs | None = None,
    ):
        self.topo, self.rank, self.modules, self.comm = topo, rank, modules, comm
        self.data, self.device = data, torch.device(device)
        self.batches = data.micro_batches
        self.tag_base, self.on_result = tag_base, on_result
        weights = RoundWeights(topo, self.batches, synchronous, flow)
        self.outputs = Outputs(topo, rank, comm, "eval", weights)
        # the run's `Dataflow` and the training forwards' outputs (the executor's `acts`):
        # a weight version this rank holds for its next forward, read by a round instead of
        # a copy sent for it (`Dataflow.eval_reads`)
        self.flow, self.training = flow, training
        # round -> [loss weighted by tokens, tokens, samples, batches]
        self.sums: dict[int, list[float]] = {}
        self.start = time.perf_counter()

    @torch.no_grad()
    def forward(self, i: int, a) -> None:
        s, j = a.stage, a.mb
        index = j % self.batches
        inputs = {n: self.data.get(n, index).to(self.device) for n in self.topo.model_inputs[s]}
        for t in self.topo.inputs[s]:
            inputs[t] = self._input(t, j)
        module = self.modules[s]
        training = module.training
        module.eval()  # dropout off; the RNG stream of training is left as it was
        try:
            out = module(**inputs)
        finally:
            module.train(training)
        for t in self.topo.outputs[s]:
            self.outputs.put(t, j, out[t])
        if s == self.topo.loss_stage:
            self._add(j, out["loss"], loss_items(self.data, index), self.data.weight(index))

    def _input(self, t: str, j: int) -> torch.Tensor:
        """Input t of evaluation batch j: the round's, or, for a weight of another rank whose
        version this rank holds for its next forward, that version (nothing was sent)."""
        mb = self.flow.eval_reads(t, j) if self.flow is not None else None
        if mb is None or self.topo.rank_of[self.topo.transfers[t].producer] == self.rank:
            return self.outputs.take(t, j)
        return self.training.peek(t, mb)

    def _add(self, j: int, loss: torch.Tensor, tokens: int, samples: int) -> None:
        r = j // self.batches
        total = self.sums.setdefault(r, [0.0, 0, 0, 0])
        if tokens:  # a batch with nothing to predict has a mean loss of 0/0: left out
            total[0] += float(loss) * tokens
        total[1] += tokens
        total[2] += samples
        total[3] += 1
        if total[3] < self.batches:
            return
        del self.sums[r]
        seconds = time.perf_counter() - self.start
        message = torch.tensor([total[0], total[1], total[2], seconds], dtype=torch.float64)
        if self.comm.global_rank != 0:
            self.comm.send_loss(self.tag_base + r, message.double().to(self.device))
        elif self.on_result is not None:
            self.on_result(r, message.double())
