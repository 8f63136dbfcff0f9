"""The event loop under `simulate`: GPUs running action lists, links carrying tensors.

    loop = EventLoop(plan, lists, groups, total_mbs=40, timeline_steps=3, micro_batches=4)
    loop.go()   # then loop.busy, loop.step_end, loop.sent_in, loop.peak, loop.timeline

A GPU starts the head of its list once it is free and the action's inputs are there. A
finished F puts its tensors on the links (one per ordered GPU pair, one tensor at a time,
in the order they were produced); a finished B sends a gradient back once all consumers of
that tensor on its GPU are done. Links, and with replicas the gradient all-reduce a stage
starts during its last backward of a step, are `Network`'s; a stage's S waits for its
all-reduce (a reduce-scatter where the stage shards its optimizer state, whose S then ends
with the all-gather of its new weights). The first S of a synchronised group on each GPU
waits for all the group's GPUs (the synchronous schedules' flush) and for every all-reduce of its own stages. Each action
kind (`KINDS`) has one handler to start it and one to finish it. A stage whose backward is
split (a W in its list) runs B for bwd_s - wgrad_s (plus recompute) and W for wgrad_s, frees
the micro-batch at W, and its weight gradients (so its all-reduce) come with its last W.

A weight read by other stages goes as the runtime sends it (`ftpipe_runtime.engine.dataflow`):
once per version of its owner's weights (`versions`, the runtime's `ForwardVersions` of the
owner), after the activations of the owner's first forward reading that version (under a
synchronous schedule, at once when the owner's GPU has stepped), arriving for every
micro-batch that reads it; its gradient goes back once per step, summed, after the last
backward of the step of its readers on a GPU (behind their activations' gradients), and
only the owner's last backward of the step waits for it.

Offloaded stages (`host.HostTraffic`, `host`): their gradient copies and sums lengthen their
B (or W) and the CPU's step their S, or, overlapped, runs beside the GPU's next actions until
the first that reads the weights it makes, which waits for it and for their upload; an
offloaded backward also waits for its activations to be fetched back; the host's marks go
on the timeline beside the actions.
"""

from __future__ import annotations

import heapq
from collections import defaultdict

from ..plan import Plan
from .network import Network
from .result import Event

# Steps in a row that took the same time (to 1e-9): a run that `settle`s ends after them. A
# GPipe or 1F1B step drains, so the first ones repeat; the asynchronous schedules of T5-3B's
# 36 plans on 8 GPUs took the same time every step from the first (WPipe's from the fourth),
# their step times and busy fractions then equal to 1e-12 those of 20 steps.
SETTLED = 3


class EventLoop:
    """The event loop. Arrivals are counted per (stage, micro-batch) in flat lists for speed."""

    def __init__(
        self,
        plan: Plan,
        lists,
        groups,
        total_mbs: int,
        timeline_steps: int,
        micro_batches: int,
        versions: dict | None = None,
        weights_once: bool = True,
        synchronous: bool = False,
        host=None,
        stop_after: int = 0,
        settle: bool = True,
    ):
        self.lists, self.cap_steps = lists, timeline_steps
        # Steps measured (0: run every list to its end): the run ends once they all ended, or
        # (`settle`) earlier once the step times settle (`SETTLED`), with `settled_at` steps
        self.stop_after, self.settle = stop_after, settle
        self.settled_at = 0
        self.done = False
        self.ends: list[float] = []  # when each step ended on every GPU that steps (E_k)
        # GPU -> its S actions a step (one per stage it holds); (GPU, step) -> those done;
        # step -> the GPUs done with it
        self.s_per_step = {g: sum(a.kind == "S" and a.mb == 0 for a in acts)
                           for g, acts in lists.items()}  # fmt: skip
        self.stepping = [g for g, n in self.s_per_step.items() if n]
        self.s_done: dict[tuple[int, int], int] = defaultdict(int)
        self.steps_in: dict[int, int] = defaultdict(int)
        self.cap_mbs = timeline_steps * micro_batches
        self.m = micro_batches
        self.net = Network(plan)
        st = {s.id: s for s in plan.stages}
        self.split = split = {a.stage for acts in lists.values() for a in acts if a.kind == "W"}
        self.gpu = {s: x.gpu for s, x in st.items()}
        # F records its graph unless the stage recomputes before B (or never runs one).
        keeps = {a.stage for acts in lists.values() for a in acts if a.kind == "B"}
        keeps -= {a.stage for acts in lists.values() for a in acts if a.recompute}
        self.fwd = {s: x.forward_s(s not in keeps) for s, x in st.items()}
        self.bwd = {s: x.bwd_s - (x.wgrad_s if s in split else 0.0) for s, x in st.items()}
        self.wgrad = {s: x.wgrad_s for s, x in st.items()}
        self.rec = {s: x.recompute_s for s, x in st.items()}
        # Seconds a stage's optimizer step takes on its GPU (Stage.step_s); the data-parallel
        # all-reduce before it is `ar_done`: when (stage, step)'s gradients are summed.
        # A stage sharding its optimizer state steps 1/replicas of its elements, then waits
        # for the new weights' all-gather (`_step_end`).
        self.step_s = {s: x.step_s / x.sharded_over(plan.replicas) for s, x in st.items()}
        self.host = host if host is not None and host.active else None
        if self.host is not None:  # offloaded: copies and sums in B (or W), the CPU's step in S
            for s, extra in host.grad_s.items():
                (self.wgrad if s in split else self.bwd)[s] += extra
            self.step_s.update(host.step_s)
        self.b_done: dict[tuple[int, int], int] = {}
        self.ar_done: dict[tuple[int, int], float] = {}
        self.stages_of = {g: [s for s in st if self.gpu[s] == g] for g in lists}
        # Forward: per producer, [(bytes, dest GPU, consumers there, once per step)];
        # backward: one gradient "slot" per (tensor, consumer GPU) that the producer waits for.
        self.out = {s: [] for s in st}
        self.grads = {s: [] for s in st}  # consumer -> [slot]
        self.need_f = dict.fromkeys(st, 0)
        self.need_b = dict.fromkeys(st, 0)
        self.slot_count: list[list[int]] = []
        self.fcount = {s: [0] * total_mbs for s in st}
        self.ftime = {s: [0.0] * total_mbs for s in st}
        self.bcount = {s: [0] * total_mbs for s in st}
        self.btime = {s: [0.0] * total_mbs for s in st}
        self.total_mbs = total_mbs
        # Owner stage -> its ForwardVersions: a weight goes once per version (from the lists).
        self.versions = versions or {}
        self.sent_version: dict[int, int] = {}  # owner stage -> the version its weights last went
        self.weights_at_step = synchronous  # a step's new weights go at once (Dataflow)
        self._transfers(plan, total_mbs, weights_once)
        # Step groups: which GPUs meet before stepping.
        self.group_of = {s: grp for grp in groups for s in grp}
        self.group_gpus = {grp: {self.gpu[s] for s in grp} for grp in groups}
        self.arrived: dict[tuple, dict[int, float]] = {}
        self.released: set[tuple] = set()
        self._gpu_state(lists, st)
        # One handler per action kind: when it may start (None: not yet) and what it sets off.
        kinds = {"F": "f", "B": "b", "W": "w", "S": "s"}
        self.start_of = {k: getattr(self, f"_start_{x}") for k, x in kinds.items()}
        self.finish_of = {k: getattr(self, f"_finish_{x}") for k, x in kinds.items()}

    def _transfers(self, plan: Plan, total_mbs: int, weights_once: bool) -> None:
        """Who sends what to whom (`out`), the gradient slots a producer waits for (`grads`,
        `slot_count`), and how many arrivals each (stage, micro-batch) needs."""
        last_b = {
            (a.stage, a.mb // self.m): a.mb
            for acts in self.lists.values()
            for a in acts
            if a.kind == "B"
        }
        # weights_once=False: every forward sends the weights it reads like an activation,
        # and its backward their gradient (the runtime before weights went once per version).
        weights = {p.name for p in plan.params} if weights_once else set()
        for t in plan.transfers:
            per_step = t.tensor in weights  # once per version; its gradient once per step
            by_gpu: dict[int, list[int]] = {}
            for c in t.consumers:
                by_gpu.setdefault(self.gpu[c], []).append(c)
                self.need_f[c] += 1
            self.out[t.producer] += [(t.bytes, g, cs, per_step) for g, cs in sorted(by_gpu.items())]
            if t.requires_grad:
                for g, cs in sorted(by_gpu.items()):
                    n = len(cs) * self.m if per_step else len(cs)  # backwards summed into one
                    slot = (len(self.slot_count), n, t.producer, t.bytes, g, per_step)
                    self.slot_count.append([0] * total_mbs)
                    self.need_b[t.producer] += 1
                    for c in cs:
                        self.grads[c].append(slot)
                    if per_step:  # only the owner's last backward of a step waits for it
                        waits = self.bcount[t.producer]
                        for mb in range(total_mbs):
                            if last_b.get((t.producer, mb // self.m)) != mb:
                                waits[mb] += 1
        for sends in self.out.values():  # weights last, as the runtime's sending order
            sends.sort(key=lambda x: x[3])
        for slots in self.grads.values():  # and their gradients last (`Dataflow.grad_order`)
            slots.sort(key=lambda x: x[5])
        self.last_b = last_b

    def _gpu_state(self, lists, st) -> None:
        """Per GPU: position in its list, when it is free, what runs; per stage: memory held."""
        self.pos = dict.fromkeys(lists, 0)
        self.free = dict.fromkeys(lists, 0.0)
        self.start = dict.fromkeys(lists, 0.0)
        self.running = dict.fromkeys(lists, False)
        self.waiting: dict[int, tuple] = {}
        # (GPU, step) -> bytes it sent for that step: the activations and weights its
        # micro-batches read, the gradients they gave back (per-step figures: `simulator`)
        self.sent_in: dict[tuple[int, int], int] = defaultdict(int)
        # (GPU, step) -> seconds it computed for that step's micro-batches (F, B, W): per step,
        # so that a window of steps counts its own work (none of the step after the last)
        self.busy: dict[tuple[int, int], float] = defaultdict(float)
        self.step_end: dict[int, dict[int, float]] = {g: {} for g in lists}
        self.held = dict.fromkeys(st, 0)
        self.peak = dict.fromkeys(st, 0)
        self.deferred = dict.fromkeys(st, 0)  # split stages: micro-batches between B and W
        self.peak_deferred = dict.fromkeys(st, 0)
        self.timeline: list[Event] = []
        self.heap: list[tuple[float, int, int]] = []
        self.seq = 0

    def go(self) -> None:
        for g in self.lists:
            self.try_start(g)
        while self.heap and not self.done:
            t, _, g = heapq.heappop(self.heap)
            self.complete(g, t)
        stuck = [g for g in self.lists if self.pos[g] < len(self.lists[g]) and not self.done]
        if stuck:  # the schedules are built not to deadlock; this would be a bug
            raise RuntimeError(
                f"simulation deadlocked at {self.lists[stuck[0]][self.pos[stuck[0]]]}"
            )

    def _push(self, g: int, start: float, end: float) -> None:
        self.running[g] = True
        self.start[g] = start
        self.seq += 1
        heapq.heappush(self.heap, (end, self.seq, g))

    def try_start(self, g: int) -> None:
        if self.running[g]:
            return
        lst, i = self.lists[g], self.pos[g]
        if i >= len(lst):
            return
        a = lst[i]
        got = self.start_of[a.kind](g, a)
        if got is not None:
            ready, dur = got
            if self.host is not None and self.host.pending:  # an overlapped CPU step lands
                landed = self.host.landing(g, a)
                if landed is not None:
                    ready, dur = max(ready, landed[0]), dur + landed[1]
            start = max(self.free[g], ready)
            self._push(g, start, start + dur)

    def _start_f(self, g: int, a):
        if self.fcount[a.stage][a.mb] < self.need_f[a.stage]:
            self.waiting[g] = ("F", a.stage, a.mb)
            return None
        return self.ftime[a.stage][a.mb], self.fwd[a.stage]

    def _start_b(self, g: int, a):
        s, m = a.stage, a.mb
        if self.bcount[s][m] < self.need_b[s]:
            self.waiting[g] = ("B", s, m)
            return None
        ready = self.btime[s][m]
        if self.host is not None:  # its offloaded activations fetched back
            ready = max(ready, self.host.fetched(g, s, m, max(self.free[g], ready)))
        return ready, self.bwd[s] + (self.rec[s] if a.recompute else 0.0)

    def _start_w(self, g: int, a):
        return 0.0, self.wgrad[a.stage]  # its B ran earlier on this GPU

    def _start_s(self, g: int, a):
        grp = self.group_of.get(a.stage)
        if grp is not None and (grp, a.mb, g) not in self.released:
            summed = max(self.ar_done.get((s, a.mb), 0.0) for s in self.stages_of[g])
            self._barrier(grp, a.mb, g, max(self.free[g], summed))
            return None
        ready = self.ar_done.get((a.stage, a.mb), 0.0)
        start = max(self.free[g], ready)  # as try_start starts it
        return ready, self._step_end(g, a.stage, start) - start

    def _step_end(self, g: int, s: int, start: float) -> float:
        """When stage s's step on GPU g, started at `start`, ends: its optimizer step, and
        where it shards its state the all-gather of the new weights (`Network.all_gather`)."""
        return self.net.all_gather(s, g, start + self.step_s[s])

    def _barrier(self, grp, step: int, g: int, arrive: float) -> None:
        """The first S of a step group on a GPU waits until every GPU of the group is there."""
        here = self.arrived.setdefault((grp, step), {})
        here[g] = arrive
        if len(here) < len(self.group_gpus[grp]):
            return
        t0 = max(here.values())
        for h in here:  # each GPU's waiting S then takes its optimizer step
            self.released.add((grp, step, h))
            self._push(h, t0, self._step_end(h, self.lists[h][self.pos[h]].stage, t0))

    def _send(self, src: int, dst: int, nbytes: int, t: float, step: int) -> float:
        if src == dst:
            return t  # `Network.send`: handed over on the GPU
        self.sent_in[src, step] += nbytes
        return self.net.send(src, dst, nbytes, t)

    def complete(self, g: int, t: float) -> None:
        a = self.lists[g][self.pos[g]]
        self.pos[g] += 1
        self.running[g] = False
        self.free[g] = t
        start = self.start[g]
        if a.mb < (self.cap_mbs if a.spec.per_micro_batch else self.cap_steps):
            kind = "R" if a.recompute else a.kind
            self.timeline.append(Event(g, a.stage, kind, a.mb, start, t))
        self.finish_of[a.kind](g, a, start, t)
        if self.host is not None:
            self.host.finished(g, a, start, t)
        self.try_start(g)

    def _finish_f(self, g: int, a, start: float, t: float) -> None:
        s, m = a.stage, a.mb
        self.busy[g, m // self.m] += t - start
        self.held[s] += 1
        self.peak[s] = max(self.peak[s], self.held[s])
        for nbytes, dst, consumers, per_step in self.out[s]:
            if not per_step:
                self._deliver(g, dst, nbytes, t, consumers, (m,))
        self._send_weights(g, s, m, t)

    def _deliver(self, g: int, dst: int, nbytes: int, t: float, consumers, mbs) -> None:
        """A tensor leaves GPU g at t for `dst`, where it is an input of `consumers`' forwards
        of micro-batches `mbs`."""
        arrive = self._send(g, dst, nbytes, t, mbs[0] // self.m)
        for c in consumers:
            count, times, need = self.fcount[c], self.ftime[c], self.need_f[c]
            for i in mbs:  # `_arrive`, inline: the hottest call of a simulation
                count[i] += 1
                if arrive > times[i]:
                    times[i] = arrive
                if count[i] == need:
                    self._ready("F", c, i)

    def _send_weights(self, g: int, s: int, m: int, t: float) -> None:
        """Stage s's weights read by other GPUs, in the version its forward of micro-batch m
        reads, unless that version went already; they arrive for every micro-batch reading
        it (consecutive ones from m on)."""
        versions = self.versions.get(s)
        if versions is None or m >= self.total_mbs:
            return
        v = versions.version(m)
        if self.sent_version.get(s) == v:
            return
        self.sent_version[s] = v
        read = range(m, min(m + versions.forwards(v), self.total_mbs))
        for nbytes, dst, consumers, per_step in self.out[s]:
            if per_step:
                self._deliver(g, dst, nbytes, t, consumers, read)

    def _finish_b(self, g: int, a, start: float, t: float) -> None:
        s, m = a.stage, a.mb
        self.busy[g, m // self.m] += t - start
        if s in self.split:
            self.deferred[s] += 1
            self.peak_deferred[s] = max(self.peak_deferred[s], self.deferred[s])
        else:
            self.held[s] -= 1
            self._gradients_done(g, s, m, start + (self.rec[s] if a.recompute else 0.0), t)
        for idx, n, producer, nbytes, _, per_step in self.grads[s]:
            counts = self.slot_count[idx]
            at = m // self.m if per_step else m  # a step's gradients are counted together
            counts[at] += 1
            if counts[at] == n:  # the last consumer on this GPU: send the summed gradient
                arrive = self._send(
                    g, self.gpu[producer], nbytes, t, at if per_step else at // self.m
                )
                to = self.last_b[(producer, at)] if per_step else m
                self._arrive(
                    self.bcount[producer],
                    self.btime[producer],
                    to,
                    arrive,
                    self.need_b[producer],
                    "B",
                    producer,
                )

    def _finish_w(self, g: int, a, start: float, t: float) -> None:
        self.busy[g, a.mb // self.m] += t - start
        self.held[a.stage] -= 1
        self.deferred[a.stage] -= 1
        self._gradients_done(g, a.stage, a.mb, start, t)

    def _gradients_done(self, g: int, s: int, m: int, grads_from: float, t: float) -> None:
        """A micro-batch's weight gradients are in (from `grads_from` to `t`); after the step's
        last, the stage's all-reduce starts (overlapping that last pass)."""
        key = (s, m // self.m)
        self.b_done[key] = self.b_done.get(key, 0) + 1
        if self.b_done[key] == self.m:
            self.ar_done[key] = self.net.all_reduce(s, g, grads_from, t)

    def _finish_s(self, g: int, a, start: float, t: float) -> None:
        self.step_end[g][a.mb] = max(self.step_end[g].get(a.mb, 0.0), t)
        if self.weights_at_step and self._last_s(g, a):  # the GPU's new weights go now
            for s in self.stages_of[g]:
                self._send_weights(g, s, (a.mb + 1) * self.m, t)
        self.s_done[g, a.mb] += 1
        if self.s_done[g, a.mb] == self.s_per_step[g]:  # the GPU is done with the step
            self.steps_in[a.mb] += 1
            if self.steps_in[a.mb] == len(self.stepping):  # every GPU is (in step order)
                self._step_ended(a.mb)

    def _step_ended(self, k: int) -> None:
        """Step k ended on every GPU: with `stop_after`, the run ends after the last step
        measured (an asynchronous pipeline's drain after it changes no figure of an ended
        step: each GPU's work, sends and S of a step are done when the step ends), or, where it
        may `settle`, once the last `SETTLED` steps took the same time."""
        ends = self.ends
        ends.append(max(self.step_end[g][k] for g in self.stepping))
        if not self.stop_after:
            return
        self.done = k + 1 >= self.stop_after
        if len(ends) <= SETTLED or self.done or not self.settle:
            return
        took = [ends[i] - ends[i - 1] for i in range(len(ends) - SETTLED, len(ends))]
        if took[-1] > 0 and all(abs(x - took[-1]) <= 1e-9 * took[-1] for x in took):
            self.settled_at, self.done = k + 1, True

    def _last_s(self, g: int, a) -> bool:
        """Is `a`, just finished, the GPU's last S of its step?"""
        acts, i = self.lists[g], self.pos[g]
        return i >= len(acts) or acts[i].kind != "S" or acts[i].mb != a.mb

    def _arrive(self, count, times, m: int, arrive: float, need: int, kind: str, s: int) -> None:
        count[m] += 1
        if arrive > times[m]:
            times[m] = arrive
        if count[m] == need:
            self._ready(kind, s, m)

    def _ready(self, kind: str, s: int, m: int) -> None:
        """Every input of stage s's `kind` of micro-batch m is in: its GPU starts it if it
        waits for it."""
        g = self.gpu[s]
        if self.waiting.get(g) == (kind, s, m):
            del self.waiting[g]
            self.try_start(g)
