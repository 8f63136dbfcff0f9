"""What a schedule is: per-stage action streams, a merge per GPU, and a statement of what it keeps.

    sched = get_schedule("2bw")
    sched.policy(stage, micro_batches=8, gpus=4)   # StagePolicy: recompute, in flight, versions
    sched.actions(stages, micro_batches=8, steps=2) # {gpu: [0F0, 0F1, ...]}

A schedule file defines a `Schedule`: a pure `stream` function giving one stage's own
ordered actions for (stage, its policy, micro-batches, steps), a `policy` function stating
what the stage keeps (the memory model and the executor read it; nothing else decides it),
the placement it needs (`Placement`), whether its optimizer step is a flush, and a
`priority` for merging the streams of stages that share a GPU (`merge.interleave`). A
schedule whose GPUs interleave their stages in a way of their own (WPipe) gives `given`, a
pure function (stages, micro-batches, steps) -> per-GPU lists, instead of `stream`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace

from ..errors import ScheduleError
from .actions import Action
from .merge import backward_first, interleave


@dataclass(frozen=True)
class StageInfo:
    id: int  # topologically ordered: a stage only receives from lower ids
    gpu: int
    depth: int  # stages on the longest path to the loss stage
    is_last: bool  # computes the loss
    chunk: int = 0  # its rank among the stages of its GPU, by id (WPipe's group)


def with_chunks(stages) -> list[StageInfo]:
    """The same stages with `chunk` set: 0 for a GPU's lowest id, 1 for the next..."""
    seen: dict[int, int] = {}
    out = []
    for s in sorted(stages, key=lambda s: s.id):
        out.append(StageInfo(s.id, s.gpu, s.depth, s.is_last, seen.get(s.gpu, 0)))
        seen[s.gpu] = seen.get(s.gpu, 0) + 1
    return out


@dataclass(frozen=True)
class StagePolicy:
    """What one stage keeps under a schedule: the input of the memory model and the executor.

    A micro-batch of step k runs forward and backward on the stage's weights after
    max(k - weight_delay, 0) optimizer steps (PipeDream-2BW's 1-stale rule is delay 1; a
    flushed schedule has 0); `weight_delay` None means each action reads the weights current
    when it runs (FTPipe's asynchronous rule, no stashing).
    """

    recompute: bool  # the backward re-runs the forward from the saved stage inputs
    in_flight: int  # most micro-batches whose inputs (or activations) the stage holds at once
    weight_versions: int = 1  # copies of its trainable weights held at once
    weight_delay: int | None = 0
    # Zero-bubble: B computes the input gradients only, W (deferred) the weight gradients. The
    # autograd graph lives from the forward (the recompute, when recomputing) until W, so a
    # micro-batch is in flight until its W, and a recomputing stage holds the full activations
    # of up to `deferred` micro-batches whose B ran and whose W has not.
    split: bool = False
    deferred: int = 0

    def version(self, mb: int, micro_batches: int) -> int | None:
        """Optimizer steps of this stage behind the weights micro-batch `mb` must use."""
        if self.weight_delay is None:
            return None
        return max(mb // micro_batches - self.weight_delay, 0)


@dataclass(frozen=True)
class Placement:
    """How a chain of stages sits on GPUs: free (the partitioner decides, any number of stages
    per GPU) or a pattern of `per_gpu` stages per GPU, chain position p on `gpu_of(p, gpus)`."""

    name: str
    per_gpu: int = 0  # 0: free
    gpu_of: Callable[[int, int], int] | None = field(default=None, compare=False, repr=False)

    @property
    def free(self) -> bool:
        return self.per_gpu == 0

    def chain(self, gpus: int) -> list[StageInfo]:
        """The stages of a chain in this pattern: positions 0 .. per_gpu * gpus - 1."""
        if self.free:
            raise ValueError("a free placement has no fixed chain")
        n = self.per_gpu * gpus
        return with_chunks(
            StageInfo(p, self.gpu_of(p, gpus), n - 1 - p, p == n - 1) for p in range(n)
        )

    def check(self, stages: list[StageInfo], gpus: int, schedule: str) -> None:
        if self.free:
            return
        want = [(s.id, s.gpu) for s in self.chain(gpus)]
        have = sorted((s.id, s.gpu) for s in stages)
        if have != want:
            raise ScheduleError(
                f"{schedule} needs {len(want)} stages placed {self.name} on {gpus} GPUs, "
                f"but the plan puts {len(have)} stages on GPUs "
                f"{[g for _, g in have][:12]}; compile the plan for this schedule "
                f"(ftpipe compile --schedule {schedule})"
            )


FREE = Placement("freely")


def looped(per_gpu: int) -> Placement:
    """Chain position p on GPU p mod P: WPipe's two groups (Figure 4), interleaved 1F1B."""
    return Placement(f"in a loop ({per_gpu} per GPU, position p on GPU p mod P)", per_gpu, _mod)


def _mod(position: int, gpus: int) -> int:
    return position % gpus


def _vee(position: int, gpus: int) -> int:
    return position if position < gpus else 2 * gpus - 1 - position


# Zero-bubble ZB-V (Qi et al. §6): 2P positions down and back up, so GPU i holds positions i
# and 2P - 1 - i, and the loss stage shares GPU 0 with the first.
V_SHAPE = Placement("in a V (position p on GPU p, then 2P - 1 - p on the way back)", 2, _vee)


Stream = Callable[[StageInfo, StagePolicy, int, int], list[Action]]
PolicyFn = Callable[[StageInfo, int, int], StagePolicy]


@dataclass(frozen=True)
class Schedule:
    name: str
    stream: Stream | None = field(repr=False, compare=False)
    policy_of: PolicyFn = field(repr=False, compare=False)
    synchronous: bool  # a step is a flush: all stages step together after all its backwards
    placement: Placement = FREE
    priority: Callable[[Action, StageInfo], tuple] | tuple = field(
        default=backward_first, repr=False, compare=False
    )
    min_micro_batches: Callable[[int], int] = field(
        default=lambda gpus: 1, repr=False, compare=False
    )
    # Per-GPU lists given whole (a CSV file) instead of merged streams: (stages, m, steps) -> lists
    given: Callable[[list[StageInfo], int, int], dict[int, list[Action]]] | None = field(
        default=None, repr=False, compare=False
    )
    micro_batches: int = 0  # the only micro-batch count it is written for (0: any)
    # (micro-batches, gpus) -> why it cannot run them ("" when it can)
    refuse: Callable[[int, int], str] | None = field(default=None, repr=False, compare=False)
    doc: str = ""

    def policy(self, stage: StageInfo, micro_batches: int, gpus: int) -> StagePolicy:
        return self.policy_of(stage, micro_batches, gpus)

    @property
    def can_keep_activations(self) -> bool:
        """May every stage keep its activations instead of recomputing? Not when a forward's
        weights change in place before its backward (FTPipe's asynchronous rule): the kept
        graph would be stale. A flushed or versioned schedule (weight_delay not None) may."""
        probe = StageInfo(0, 0, 1, False)
        return self.given is None and self.policy_of(probe, 2, 2).weight_delay is not None

    def without_recompute(self) -> Schedule:
        """The same schedule with every stage keeping its activations (no recompute): more
        memory, less compute. A planner's choice; `can_keep_activations` says where allowed."""
        if not self.can_keep_activations:
            raise ScheduleError(
                f"{self.name} must recompute: its backwards run on weights newer than their "
                "forward's, so a kept graph would be stale"
            )
        policy_of = self.policy_of

        def keeping(st: StageInfo, m: int, gpus: int) -> StagePolicy:
            return replace(policy_of(st, m, gpus), recompute=False)

        return replace(self, policy_of=keeping)

    def policies(self, stages: list[StageInfo], micro_batches: int) -> dict[int, StagePolicy]:
        gpus = max((s.gpu for s in stages), default=0) + 1
        return {s.id: self.policy(s, micro_batches, gpus) for s in with_chunks(stages)}

    def check(self, stages: list[StageInfo], micro_batches: int) -> None:
        """Raise ScheduleError when these stages or micro-batches cannot run this schedule."""
        gpus = max((s.gpu for s in stages), default=0) + 1
        self.placement.check(stages, gpus, self.name)
        if self.micro_batches and micro_batches != self.micro_batches:
            raise ScheduleError(
                f"{self.name} is written for {self.micro_batches} micro-batches per step, "
                f"not {micro_batches}; pass --micro-batches {self.micro_batches}"
            )
        need = self.min_micro_batches(gpus)
        if micro_batches < need:
            raise ScheduleError(
                f"{self.name} needs at least {need} micro-batches per step on {gpus} GPUs, "
                f"not {micro_batches}; pass --micro-batches {need} or more"
            )
        why = self.refuse(micro_batches, gpus) if self.refuse else ""
        if why:
            raise ScheduleError(why)

    def stage_actions(self, st: StageInfo, micro_batches: int, steps: int, gpus: int):
        """One stage's own actions (a schedule that orders whole GPU lists has none)."""
        if self.stream is None:
            raise ValueError(f"{self.name} orders whole GPU lists, not one stage's")
        return self.stream(st, self.policy(st, micro_batches, gpus), micro_batches, steps)

    def actions(
        self, stages: list[StageInfo], micro_batches: int, steps: int = 1
    ) -> dict[int, list[Action]]:
        """The ordered action list of every GPU: each stage's stream, merged per GPU."""
        if micro_batches < 1 or steps < 1:
            raise ValueError(
                f"need micro_batches >= 1 and steps >= 1, not {micro_batches}, {steps}"
            )
        stages = with_chunks(stages)
        self.check(stages, micro_batches)
        if self.given is not None:
            return self.given(stages, micro_batches, steps)
        gpus = max(s.gpu for s in stages) + 1
        per_stage = {s.id: self.stage_actions(s, micro_batches, steps, gpus) for s in stages}
        return interleave(stages, per_stage, self.step_groups(stages), self.priority)

    def step_groups(self, stages: list[StageInfo]) -> tuple[tuple[int, ...], ...]:
        """Stage sets whose optimizer steps happen together: under a synchronous schedule
        every stage (the flush: no GPU starts step k+1 before all of step k is done, and one
        gradient norm clips them all); otherwise none, every stage steps at its own S (a
        weight read by several stages travels with the micro-batches)."""
        if self.synchronous:
            return (tuple(sorted(s.id for s in stages)),)
        return ()


def one_f_one_b(
    st: StageInfo, first: int, count: int, warmup: int, rec: bool, m: int, lag: int | None = None
) -> list[Action]:
    """`warmup` forwards, then one backward / one forward, then the remaining backwards;
    an optimizer step after every m-th backward (micro-batches `first` .. `first + count`,
    `first` a multiple of m).

    With `lag` (a split backward), W of micro-batch i comes right after B of i + lag (ZB-H1's
    deferred weight passes), the W's still due at the end, and a step after its m-th W."""
    out = [Action("F", st.id, first + j) for j in range(min(warmup, count))]
    closed = 0  # micro-batches whose gradients are in (B, or W when split)

    def close(mb: int) -> None:
        nonlocal closed
        if lag is not None:
            out.append(Action("W", st.id, mb))
        closed += 1
        if closed % m == 0:
            out.append(Action("S", st.id, (first + closed - 1) // m))

    for i in range(count):
        out.append(Action("B", st.id, first + i, rec))
        if i >= (lag or 0):
            close(first + i - (lag or 0))
        if i + warmup < count:
            out.append(Action("F", st.id, first + i + warmup))
    for i in range(max(count - (lag or 0), 0), count):
        close(first + i)
    return out


def flushed(st: StageInfo, policy: StagePolicy, m: int, steps: int) -> list[Action]:
    """1F1B within each step, nothing of step k + 1 before the step of k (warm-up = in flight)."""
    return [
        a
        for k in range(steps)
        for a in one_f_one_b(st, k * m, m, policy.in_flight, policy.recompute, m)
    ]


def streamed(st: StageInfo, policy: StagePolicy, m: int, steps: int) -> list[Action]:
    """One 1F1B stream across steps (no flush): `in_flight` forwards ahead, a step every m."""
    return one_f_one_b(st, 0, m * steps, policy.in_flight, policy.recompute, m)
