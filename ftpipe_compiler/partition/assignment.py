"""A partition under search: incremental plan figures for the partitioners' inner loops.

`build_plan` is exact but rebuilds every stage; a search that tries thousands of moves
keeps an `Assignment` instead: nodes are integers (graph order), and moving one node updates
only what it touches. Its period, communication and memory follow `Plan` to the byte
(tests compare the two), so an assignment that fits here fits as a plan.

    lay = Assignment(NodeCosts.of(problem), stage_of=[...], gpu_of=[...])
    # (stages renumbered topologically)
    lay.move([i, j], stage); lay.period(); lay.fits()
"""

from __future__ import annotations

from collections import defaultdict

from ftpipe_runtime.schedules import StageInfo

from ..costs.formulas import gpu_memory_bytes, period_s, stage_memory
from .indexed import NodeCosts, topological_stages


class Assignment:
    """Node -> stage (stages numbered topologically), stage -> GPU, with running figures."""

    def __init__(self, costs: NodeCosts, stage_of: list[int], gpu_of: dict[int, int] | list[int]):
        old = list(stage_of)
        stage = topological_stages(costs, old)
        gpu = [0] * (max(stage) + 1)
        for i, s in enumerate(stage):
            gpu[s] = gpu_of[old[i]]
        self._setup(costs, stage, gpu)

    @classmethod
    def restore(cls, costs: NodeCosts, stage: list[int], gpu: list[int]) -> Assignment:
        """The assignment whose books were `stage` and `gpu` (a refined one's, emptied stages
        and numbering as they were): the same figures and the same moves from here on."""
        lay = cls.__new__(cls)
        lay._setup(costs, list(stage), list(gpu))
        return lay

    def _setup(self, costs: NodeCosts, stage: list[int], gpu: list[int]) -> None:
        c = self.c = costs
        self.stage, self.gpu, self.nstages = stage, gpu, len(gpu)
        self.gpus = costs.problem.gpus
        self.on = [[s for s in range(self.nstages) if self.gpu[s] == g] for g in range(self.gpus)]
        S, G = self.nstages, self.gpus
        self.size, self.rec, self.last, self.act = [0] * S, [0.0] * S, [0.0] * S, [0] * S
        self.input_bytes = [0] * S  # what each stage receives (tensors, model inputs, weights)
        self.stage_readers = [defaultdict(int) for _ in range(c.n)]  # tensor readers per stage
        self.gpu_readers = [defaultdict(int) for _ in range(c.n)]  # ... per GPU
        self.input_readers = [defaultdict(int) for _ in range(S)]  # model input readers
        self.param_readers = [defaultdict(int) for _ in c.pstatic]  # param readers per stage
        self.fwd, self.bwd = [0] * G, [0] * G
        # Parameter bytes each stage owns: trainable weights (kept per version), frozen, state.
        self.trainable, self.frozen, self.state = [0] * S, [0] * S, [0] * S
        # Tensor and weight edges between stages: stage -> {later stage: how many}
        self.out_edges: list[dict[int, int]] = [defaultdict(int) for _ in range(S)]
        self._flipped: set[int] = set()  # stages that gained or lost a successor stage
        self._pols, self._pols_loss, self._epoch = {}, -1, 0  # stage policies, see _policy
        # Per-GPU period and memory, kept until a move changes what they read (see _touch):
        # a refinement tries thousands of moves, each touching two or three GPUs of many.
        self._period: list[float | None] = [None] * G
        self._mem: list[int | None] = [None] * G
        self._stale: set[int] = set(range(G))  # GPUs whose period went (see periods)
        self._period_epoch = -1  # the policy epoch the loss GPU's period was counted under
        self._mem_epoch = -1  # the policy epoch the kept memory was counted under
        # What each GPU's stages may hold: `problem.memory`, until the plan's own count of a
        # GPU says less is left beside them (partition/fit.py tightens it).
        self.budget = [costs.problem.memory] * G
        self._build()
        self._depths()

    # --- figures ---
    @property
    def loss(self) -> int:
        return self.stage[self.c.output]

    def compute(self, g: int) -> float:
        loss = self.loss
        if loss not in self.on[g]:
            return sum(self.rec[s] for s in self.on[g])
        keeps = self.c.loss_keeps
        if keeps is None:  # it depends on where the loss stage sits: ask its policy
            keeps = not self._policy(loss).recompute
        return sum(self.last[s] if s == loss and keeps else self.rec[s] for s in self.on[g])

    def _policy(self, s: int):
        """What stage s keeps under the schedule, as `Plan` will see it (cached per stage
        until a depth, the loss stage or the set of non-empty stages changes)."""
        epoch, loss = self._epoch_now(), self.loss
        got = self._pols.get(s)
        if got is not None and got[0] == epoch:
            return got[1]
        g = self.gpu[s]
        chunk = sum(1 for t in self.on[g] if t < s and self.size[t])
        policy = self.c.problem.policy(StageInfo(s, g, self.depth[s], s == loss, chunk))
        self._pols[s] = (epoch, policy)
        return policy

    def _epoch_now(self) -> int:
        """The policies' epoch, brought up to date: it moves on when a depth, the loss stage
        or the set of non-empty stages changes."""
        if self._dirty:
            self._depths()
        loss = self.loss
        if loss != self._pols_loss:
            self._pols_loss, self._epoch = loss, self._epoch + 1
        return self._epoch

    def gpu_period(self, g: int) -> float:
        self._policies_settled()
        return self._gpu_period(g)

    def _gpu_period(self, g: int) -> float:
        got = self._period[g]
        if got is None:
            bw = self.c.problem.bandwidth
            got = self._period[g] = period_s(self.compute(g), self.fwd[g] / bw, self.bwd[g] / bw)
        return got

    def _policies_settled(self) -> None:
        """The loss GPU's compute asks its stage's policy, which may change without a move
        touching that GPU (a depth, a stage elsewhere emptied): its period is kept only while
        the policies' epoch is the one it was counted under."""
        if self.c.loss_keeps is not None:  # the schedule says what it keeps, wherever it is
            return
        epoch = self._epoch_now()
        if epoch != self._period_epoch:
            self._period[self.gpu[self.loss]] = None
            self._period_epoch = epoch

    def periods(self) -> list[float]:
        self._policies_settled()
        per = self._period
        for g in self._stale:
            if per[g] is None:
                self._gpu_period(g)
        self._stale.clear()
        self._gpu_period(self.gpu[self.loss])
        return per.copy()

    def period(self) -> float:
        return max(self.periods())

    def comm_bytes(self) -> int:
        return sum(self.fwd) + sum(self.bwd)

    def memory(self, g: int) -> int:
        epoch = self._epoch_now()
        if self._mem_epoch != epoch:  # policies may have changed: all stale
            self._mem_epoch, self._mem = epoch, [None] * self.gpus
        if self._mem[g] is None:
            self._mem[g] = self._memory(g)
        return self._mem[g]

    def overflow(self) -> int:
        """Bytes over budget, all GPUs together: `memory` of each, the checks made once (a
        fit search asks after every trial move, and most GPUs' figures are kept)."""
        epoch = self._epoch_now()
        if self._mem_epoch != epoch:
            self._mem_epoch, self._mem = epoch, [None] * self.gpus
        mem, total = self._mem, 0
        for g, budget in enumerate(self.budget):
            got = mem[g]
            if got is None:
                got = mem[g] = self._memory(g)
            if got > budget:
                total += got - budget
        return total

    def _memory(self, g: int) -> int:
        parts = []
        for s in self.on[g]:
            if not self.size[s]:
                continue
            parts.append(
                stage_memory(
                    trainable_bytes=self.trainable[s],
                    frozen_bytes=self.frozen[s],
                    state_bytes=self.state[s],
                    input_bytes=self.input_bytes[s],
                    act_bytes=self.act[s],
                    policy=self._policy(s),
                )
            )
        return gpu_memory_bytes(parts)

    def fits(self, gpus=None) -> bool:
        budget = self.budget
        return all(
            self.memory(g) <= budget[g] for g in (range(self.gpus) if gpus is None else gpus)
        )

    def stage_of(self) -> dict[str, int]:
        return dict(zip(self.c.ids, self.stage))

    def gpu_of(self) -> dict[int, int]:
        return dict(enumerate(self.gpu))

    def _build(self) -> None:
        """The books as moving every node in from nowhere would leave them (`_move_node`
        keeps them from then on; test_assignment checks the two agree), counted in one pass
        over nodes, tensors, model inputs and parameters: a search builds dozens of these."""
        c, stage, gpu = self.c, self.stage, self.gpu
        size, rec, last, act = self.size, self.rec, self.last, self.act
        input_bytes, edges = self.input_bytes, self.out_edges
        for i in range(c.n):  # in node order: float sums as moving them in one by one
            s = stage[i]
            size[s] += 1
            rec[s] += c.rec[i]
            last[s] += c.last[i]
            act[s] += c.act[i]
            for u in c.preds[i]:
                su = stage[u]
                self.stage_readers[u][s] += 1
                self.gpu_readers[u][gpu[s]] += 1
                if su != s:
                    edges[su][s] += 1
            for x in c.inputs[i]:
                self.input_readers[s][x] += 1
            for p in c.params[i]:
                self.param_readers[p][s] += 1
        for u in range(c.n):  # tensor u: each other stage reading it receives it once
            su = stage[u]
            for s in self.stage_readers[u]:
                if s != su:
                    input_bytes[s] += c.out[u]
            g, b = gpu[su], c.out[u]
            for h in self.gpu_readers[u]:
                if h != g:
                    self.fwd[g] += b
                    if c.grad[u]:
                        self.bwd[h] += b
        for s in range(self.nstages):
            for x in self.input_readers[s]:
                input_bytes[s] += c.input_bytes[x]
        for p in range(len(c.pstatic)):
            if self.param_readers[p]:
                self._param(p, +1)

    # --- moves ---
    def move(self, nodes, t: int) -> list[int]:
        """Move nodes to stage t; returns their previous stages (for `undo`)."""
        before = [self.stage[i] for i in nodes]
        for i in nodes:
            self._move_node(i, t)
        return before

    def undo(self, nodes, before: list[int]) -> None:
        for i, s in zip(reversed(nodes), reversed(before)):
            self._move_node(i, s)

    def _move_node(self, i: int, t: int) -> None:
        """Node i (placed: `_build` placed them all) to stage t, every book kept."""
        c, stage, a = self.c, self.stage, self.stage[i]
        if a == t:
            return
        ga, gt = self.gpu[a], self.gpu[t]
        period, mem, stale = self._period, self._mem, self._stale  # _touch, inline: hot
        period[ga] = mem[ga] = period[gt] = mem[gt] = None
        stale.add(ga)
        stale.add(gt)
        if ga != gt:  # tensor i now leaves from gt (its readers' GPUs are as they were)
            self._sender(i, ga, -1)
            self._sender(i, gt, +1)
        # Tensor i: stages that now receive it, or no longer do.
        readers, out, input_bytes = self.stage_readers[i], c.out[i], self.input_bytes
        if readers.get(a):
            input_bytes[a] += out
        if readers.get(t):
            input_bytes[t] -= out
        edge = self._edge
        for j in c.succs[i]:
            sj = stage[j]
            if sj != a:
                edge(a, sj, -1)
            if sj != t:
                edge(t, sj, +1)
        consumer = self._consumer
        for u in c.preds[i]:
            su = stage[u]
            consumer(u, su, a, ga, -1)
            if su != a:
                edge(su, a, -1)
            consumer(u, su, t, gt, +1)
            if su != t:
                edge(su, t, +1)
        if c.inputs[i]:
            on_a, on_t = self.input_readers[a], self.input_readers[t]
            for x in c.inputs[i]:
                on_a[x] -= 1
                if not on_a[x]:
                    input_bytes[a] -= c.input_bytes[x]
                if not on_t[x]:
                    input_bytes[t] += c.input_bytes[x]
                on_t[x] += 1
        for p in c.params[i]:
            self._param(p, -1)
            readers_p = self.param_readers[p]
            readers_p[a] -= 1
            readers_p[t] += 1
            self._param(p, +1)
        size = self.size
        if size[a] == 1 or not size[t]:
            self._epoch += 1  # a stage empties or fills: chunks may shift
        size[a] -= 1
        self.rec[a] -= c.rec[i]
        self.last[a] -= c.last[i]
        self.act[a] -= c.act[i]
        size[t] += 1
        self.rec[t] += c.rec[i]
        self.last[t] += c.last[i]
        self.act[t] += c.act[i]
        stage[i] = t

    def _touch(self, g: int) -> None:
        """GPU g's figures changed (its stages' work, bytes, inputs or parameters)."""
        self._period[g] = self._mem[g] = None
        self._stale.add(g)

    def _consumer(self, u: int, su: int, s: int, g: int, d: int) -> None:
        """One more (d=+1) or one fewer (d=-1) consumer of tensor u in stage s on GPU g (the
        caller, `_move_node`, has touched g: a node of s moves)."""
        readers = self.stage_readers[u]
        if d < 0:
            readers[s] -= 1
            if not readers[s] and su != s:
                self.input_bytes[s] -= self.c.out[u]
        else:
            if not readers[s] and su != s:
                self.input_bytes[s] += self.c.out[u]
            readers[s] += 1
        on_gpu = self.gpu_readers[u]
        had = on_gpu[g]
        on_gpu[g] = had + d
        if su >= 0 and g != self.gpu[su] and not (had and had + d):  # g starts or stops reading
            self._transfer(u, self.gpu[su], g, d)

    def _sender(self, u: int, g: int, sign: int) -> None:
        """Add or remove tensor u's transfers as sent from GPU g: once per other GPU reading
        it (g < 0: not placed, nothing sent)."""
        if g < 0:
            return
        for h, k in self.gpu_readers[u].items():
            if k and h != g:
                self._transfer(u, g, h, sign)

    def _transfer(self, u: int, src: int, dst: int, sign: int) -> None:
        """Tensor u sent from GPU src to GPU dst (sign=+1) or no longer (-1), its gradient
        coming back if it carries one."""
        b = self.c.out[u]
        period, mem, stale = self._period, self._mem, self._stale  # _touch, inline: hot
        self.fwd[src] += sign * b
        period[src] = mem[src] = None
        stale.add(src)
        if self.c.grad[u]:
            self.bwd[dst] += sign * b
            period[dst] = mem[dst] = None
            stale.add(dst)

    def _param(self, p: int, sign: int) -> None:
        """Add or remove parameter p's state and traffic: static bytes on its owner's GPU (the
        lowest reader stage), the weight sent to every other reader, its gradient back."""
        stages = sorted(s for s, k in self.param_readers[p].items() if k)
        if not stages:
            return
        own, g, b = stages[0], self.gpu[stages[0]], self.c.pbytes[p]
        for s in stages:  # the owner's state and bytes sent, each reader's inputs
            self._touch(self.gpu[s])
        self.trainable[own] += sign * self.c.ptrainable[p]
        self.frozen[own] += sign * self.c.pfrozen[p]
        self.state[own] += sign * self.c.pstate[p]
        dests = {self.gpu[s] for s in stages[1:]} - {g}
        self.fwd[g] += sign * b * len(dests)
        if self.c.ptrain[p]:
            for h in dests:
                self.bwd[h] += sign * b
        for s in stages[1:]:
            self.input_bytes[s] += sign * b
            self._edge(own, s, sign)

    def _edge(self, a: int, b: int, d: int) -> None:
        if a < 0 or a == b:
            return
        out = self.out_edges[a]
        k = out[b]
        out[b] = k + d
        if k == 0 or k + d == 0:
            self._dirty = True
            self._flipped.add(a)

    def _depths(self) -> None:
        """Each stage's depth: the longest path of stage edges from it. Edges go to higher
        stages, so the depths are the one solution of depth[s] = max(depth[t] + 1 over its
        successors t, or 0): where the depths known still solve it at every stage whose
        successors changed, they are the depths (most trial moves leave them)."""
        flipped, self._flipped = self._flipped, set()
        depth, out = getattr(self, "depth", None), self.out_edges

        def solved(s: int) -> int:  # the equation's right-hand side at stage s
            return max((depth[t] + 1 for t, k in out[s].items() if k), default=0)

        if depth is not None and all(solved(s) == depth[s] for s in flipped):
            self._dirty = False
            return
        depth = [0] * self.nstages
        for s in range(self.nstages - 1, -1, -1):  # edges go to higher stages: those first
            depth[s] = solved(s)
        if depth != getattr(self, "depth", None):
            self._epoch += 1
        self.depth, self._dirty = depth, False
