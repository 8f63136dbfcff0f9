"""What offloading adds to a simulated step: traffic on each GPU's host link and the CPU's step.

    traffic = HostTraffic(plan, lists)          # None-free: a plan without offload adds nothing
    traffic.grad_s[s], traffic.step_s[s]        # seconds the engine adds to a B (or W) and an S
    traffic.fetched(gpu, stage, mb, now)        # when an offloaded backward's inputs are back
    traffic.finished(gpu, action, start, end)   # after each action: copies out, timeline marks
    traffic.landing(gpu, action)                # an overlapped CPU step it waits for, and upload
    offload_lines(plan, result, hidden)         # what was offloaded and why, for people
    (the share of the CPU step the schedule hides: `simulator.cpu_step_hidden`)

As the runtime does it (`ftpipe_runtime.train.offload`), a stage whose optimizer is offloaded
copies each gradient to the host as its backward makes it, on the GPU's one stream (in order
with the compute: the backward is that much longer), and the rank's thread adds it into the
fp32 sum on the host before it goes on (`grad_s`: the gradients' bytes over the GPU's share
of the host link, plus the sum's bytes over its share of the CPUs' `sum_bandwidth`; a split
backward's W makes them). A stage that sums its gradients on the device
(`Offload.sums_on_device`) adds nothing to its backwards: its S copies the sums down once (4
bytes an element under mixed precision, on the link: not overlapped with any backward).
The CPU step (`step_bandwidth`, and the new weights' conversion at `sum_bandwidth`) then
runs on the rank's step thread, one stage's after another (`overlapped`: one replica; a GPU
that sends weights at a synchronous step waits for it there, as `step_s` whole), beside the
GPU's next actions, and lands before the first that reads the weights it makes, which waits
for it and carries the upload (`landing`, by `costs.host.lands`): the stage's next S, or its
next forward or recomputing backward on the weights the step made (FTPipe's and a flush's
next forward; under PipeDream-2BW and WPipe the first on the new version, a step later;
never a backward through a kept graph); a lagged stage's (`Offload.lagged`) at its next S
only. What the CPU step costs the step is then what neither the GPU's own next actions nor
the other GPUs hide: under FTPipe no GPU waits for another's step, so a GPU with slack
absorbs it; under a flush only the next step's forwards of the stages before an offloaded
one (which its own first forward waits for) hide it.

A stage whose activations are offloaded copies what it keeps for a backward (its inputs
where it recomputes, else its activations) to the host after each forward, on a copy stream
beside the compute, and fetches it back one backward ahead: the fetch for a micro-batch is
issued when the stage's previous backward starts (or when the backward is due, for the
first), so a backward waits only for what that did not hide; a forward whose stage's next
backward is its own micro-batch's keeps its tensors (1F1B's last stage parks nothing). Each direction of a GPU's link
carries one copy at a time (the gradient copies above occupy it too).

A GPU's share of its node's link and CPUs is `Host.share` of the GPUs of the node that
offload something (all of them streaming at once: a bound). `events` are the host's marks
on the timeline (kinds `HOST_KINDS`), for the report.
"""

from __future__ import annotations

from dataclasses import replace

from ftpipe_runtime.train.offload import may_lag

from ..costs.host import Offload, host_memory, lands, nodes_of, optimizer_times
from ..plan import Plan
from ..units import size
from .result import Event, SimResult

__all__ = ["HOST_KINDS", "HostTraffic", "offload_lines", "offloaded", "overlapped"]

HOST_KINDS = {
    "D": "gradients to the host",
    "C": "optimizer step on the CPU",
    "U": "weights back to the GPU",
    "O": "activations to the host",
    "I": "activations back to the GPU",
}


class HostTraffic:
    """The host side of one simulation (see the module doc): what offloading adds to each
    stage's actions, its copies' times on each GPU's link, the timeline's host marks."""

    def __init__(
        self, plan: Plan, lists, timeline_mbs: int, timeline_steps: int, *,
        synchronous: bool = False,
    ):  # fmt: skip
        self.cap_mbs, self.cap_steps = timeline_mbs, timeline_steps
        policies = plan.policies
        offloading = {s.gpu for s in plan.stages if s.offload.any}
        share = {}
        for gpus in nodes_of(plan).values():
            k = sum(1 for g in gpus if g in offloading)
            for g in gpus:
                share.setdefault(g, plan.host.share(k))
        self.link = {g: share[g][0] for g in share}
        self.gpu = {s.id: s.gpu for s in plan.stages}
        self.grad_s: dict[int, float] = {}  # stage -> added to each B (or W)
        self.step_s: dict[int, float] = {}  # stage -> its S on the host
        self.cpu_s: dict[int, float] = {}  # stage -> the CPU step alone
        self.grad_bytes: dict[int, int] = {}  # stage -> to the host per micro-batch
        self.sum_s: dict[int, float] = {}  # stage -> its sums to the host at its S (on device)
        self.sum_bytes: dict[int, int] = {}  # stage -> to the host once a step (on device)
        self.up_bytes: dict[int, int] = {}  # stage -> its new weights back, once a step
        self.kept: dict[int, int] = {}  # stage -> activations to the host per micro-batch
        overlap = overlapped(plan, synchronous)
        self.overlap: dict[int, tuple[float, float]] = {}  # stage -> (on the CPU, upload)
        self.pending: dict[int, tuple[int, float]] = {}  # stage -> (its step, when done)
        # Stages whose next gradients came while their CPU step still ran: the second sum
        # (`HostOffload._add`'s, apart) held beside the step's (`costs.host.sums_apart`).
        self.apart: set[int] = set()
        self.cpu_free: dict[int, float] = {}  # GPU -> when its rank's step thread is free
        self.uploading: dict[int, tuple[int, int, float]] = {}  # GPU -> (stage, step, s)
        self.m = plan.micro_batches
        for s in plan.stages:
            if s.offload.optimizer:
                t = optimizer_times(plan, s, share[s.gpu])
                if s.offload.sums_on_device:
                    self.sum_s[s.id], self.sum_bytes[s.id] = t.sum_s, t.sum_bytes
                else:
                    self.grad_bytes[s.id] = t.grad_bytes
                    self.grad_s[s.id] = t.grad_s
                self.cpu_s[s.id], self.up_bytes[s.id] = t.cpu_s, t.up_bytes
                self.step_s[s.id] = t.step_s
                if s.id in overlap:  # the S copies the sums down; the rest runs beside
                    link_s = t.up_bytes / self.link[s.gpu]
                    self.overlap[s.id] = (t.cpu_s + t.upload_s - link_s, link_s)
                    self.step_s[s.id] = t.sum_s
            if s.offload.activations and not s.forward_only:
                recompute = policies[s.id].recompute
                self.kept[s.id] = s.input_bytes if recompute else s.act_bytes
        self.policies = policies
        # An offloaded step that lands at its stage's next S (`Offload.step`), where the
        # schedule allows it (`may_lag`, as the runtime's `job.prepare._lagged` decides).
        self.lagged = {
            s.id for s in plan.stages
            if s.offload.lagged and s.id in self.overlap and may_lag(policies[s.id])
        }  # fmt: skip
        self.split = {a.stage for acts in lists.values() for a in acts if a.kind == "W"}
        # A forward whose stage's next backward is the same micro-batch's keeps its tensors
        # on the GPU, as the runtime does (`act_offload`: every forward of 1F1B's last stage,
        # GPipe's last before its backwards): the round trip would only cost.
        self.stays: set[tuple[int, int]] = set()
        forwards = dict.fromkeys(self.kept, 0)
        for acts in lists.values():
            next_b: dict[int, int] = {}
            for a in reversed(acts):
                if a.stage not in self.kept:
                    continue
                if a.kind == "B":
                    next_b[a.stage] = a.mb
                elif a.kind == "F":
                    forwards[a.stage] += 1
                    if next_b.get(a.stage) == a.mb:
                        self.stays.add((a.stage, a.mb))
        stay = {s: sum(1 for t, _ in self.stays if t == s) for s in self.kept}
        self.parked_share = {s: 1 - stay[s] / max(forwards[s], 1) for s in self.kept}
        # Each stage's backwards in list order: the one before each, whose start may fetch it.
        self.previous: dict[tuple[int, int], int] = {}
        for acts in lists.values():
            last: dict[int, int] = {}
            for a in acts:
                if a.kind == "B" and a.stage in self.kept:
                    if a.stage in last:
                        self.previous[(a.stage, a.mb)] = last[a.stage]
                    last[a.stage] = a.mb
        self.out_done: dict[tuple[int, int], float] = {}
        self.b_start: dict[tuple[int, int], float] = {}
        self.fetch_done: dict[tuple[int, int], float] = {}
        self.d2h_free: dict[int, float] = {}
        self.h2d_free: dict[int, float] = {}
        self.events: list[Event] = []

    @property
    def active(self) -> bool:
        return bool(self.step_s or self.kept)

    def fetched(self, g: int, s: int, m: int, now: float) -> float:
        """When micro-batch m's kept tensors are back on GPU g for the backward due at `now`
        (0.0 when the stage offloads none); the backward then starts and may fetch the next."""
        if s not in self.kept:
            return 0.0
        if (s, m) in self.stays:
            self.b_start[(s, m)] = now
            return 0.0
        done = self.fetch_done.get((s, m))
        if done is None:
            before = self.previous.get((s, m))
            issue = self.b_start.get((s, before), now) if before is not None else now
            start = max(issue, self.out_done.get((s, m), 0.0), self.h2d_free.get(g, 0.0))
            done = start + self.kept[s] / self.link[g]
            self.fetch_done[(s, m)] = self.h2d_free[g] = done
            self._mark(g, s, "I", m, start, done)
        self.b_start[(s, m)] = max(now, done)
        return done

    def landing(self, g: int, a) -> tuple[float, float] | None:
        """Before `a` starts on GPU g: (when the overlapped step it waits for is done, the
        upload it then adds to `a`), or None: where the executor lands it (`costs.host.lands`:
        its next S, or a forward or recomputing backward on the weights the step made; a
        lagged one's at its next S only)."""
        held = self.pending.get(a.stage)
        if held is None:
            return None
        k, done = held
        if not lands(a, self.policies[a.stage], self.m, k, lagged=a.stage in self.lagged):
            return None
        del self.pending[a.stage]
        up = self.overlap[a.stage][1]
        self.uploading[g] = (a.stage, k, up)
        return done, up

    def finished(self, g: int, a, start: float, end: float) -> None:
        """Action `a` ran on GPU g from `start` to `end`: its copies out, its marks."""
        s = a.stage
        landed = self.uploading.pop(g, None)
        if landed is not None:
            self._mark(g, landed[0], "U", landed[1], start, start + landed[2], step=True)
        if a.kind == "S" and s in self.overlap:  # the step on the rank's thread, from now
            down = start + self.sum_s.get(s, 0.0)
            if s in self.sum_s:
                self.d2h_free[g] = max(self.d2h_free.get(g, 0.0), down)
                self._mark(g, s, "D", a.mb, start, down, step=True)
            begin = max(end, self.cpu_free.get(g, 0.0))
            done = self.cpu_free[g] = begin + self.overlap[s][0]
            self.pending[s] = (a.mb, done)
            self._mark(g, s, "C", a.mb, begin, done, step=True)
            return
        if a.kind == "F" and s in self.kept:
            if (s, a.mb) in self.stays:
                return
            begin = max(end, self.d2h_free.get(g, 0.0))
            done = self.out_done[(s, a.mb)] = self.d2h_free[g] = begin + self.kept[s] / self.link[g]
            self._mark(g, s, "O", a.mb, begin, done)
        elif s in self.grad_s and (a.kind == "W" or (a.kind == "B" and s not in self.split)):
            if s in self.pending and start < self.pending[s][1]:  # (its first gradient: soon)
                self.apart.add(s)
            copy = self.grad_bytes[s] / self.link[g]
            begin = end - self.grad_s[s]
            self.d2h_free[g] = max(self.d2h_free.get(g, 0.0), begin + copy)
            self._mark(g, s, "D", a.mb, begin, begin + copy)
        elif a.kind == "S" and s in self.step_s:
            down = start + self.sum_s.get(s, 0.0)
            if s in self.sum_s:  # the step's sums, once, before the CPU step
                self.d2h_free[g] = max(self.d2h_free.get(g, 0.0), down)
                self._mark(g, s, "D", a.mb, start, down, step=True)
            cpu = down + self.cpu_s[s]
            self._mark(g, s, "C", a.mb, down, cpu, step=True)
            self._mark(g, s, "U", a.mb, cpu, end, step=True)

    def _mark(self, g, s, kind, mb, start, end, step: bool = False) -> None:
        if mb < (self.cap_steps if step else self.cap_mbs):
            self.events.append(Event(g, s, kind, mb, start, end))

    def per_step(self, m: int) -> dict[int, dict]:
        """GPU -> its host traffic and CPU step per optimizer step (m micro-batches)."""
        out = {g: {"down": 0, "up": 0, "cpu_s": 0.0} for g in self.link}
        for s, cpu_s in self.cpu_s.items():
            g, nbytes = self.gpu[s], self.grad_bytes.get(s)
            out[g]["down"] += self.sum_bytes[s] if nbytes is None else m * nbytes
            out[g]["up"] += self.up_bytes[s]
            out[g]["cpu_s"] += cpu_s
        for s, nbytes in self.kept.items():
            g, parked = self.gpu[s], round(m * nbytes * self.parked_share[s])
            out[g]["down"] += parked
            out[g]["up"] += parked
        return out


def overlapped(plan: Plan, synchronous: bool) -> set[int]:
    """Stages whose CPU step runs beside their GPU's next actions, as the runtime's
    (`ftpipe_runtime.train.stepping`): offloaded optimizer, one replica (replicas sum into
    the masters' gradients as they arrive; a sharded stage has replicas and no offload),
    and, under a synchronous schedule, on a GPU that sends none of its weights to other
    stages at its step."""
    if plan.replicas > 1:
        return set()
    owners = plan.weight_owners()
    sending = {s.gpu for s in plan.stages if s.id in owners} if synchronous else set()
    return {s.id for s in plan.stages if s.offload.optimizer and s.gpu not in sending}


def offloaded(plan: Plan) -> bool:
    return any(s.offload.any for s in plan.stages)


def offload_lines(
    plan: Plan, sim: SimResult | None = None, hidden: float | None = None,
    lagged_s: float | None = None,
) -> list[str]:  # fmt: skip
    """What the plan offloads, per stage, and why; with its simulation, the host's traffic
    per step (and `hidden`, `cpu_step_hidden`'s share; `lagged_s`, the step under
    --offload-step lagged: `simulator.offload_report` gives both). [] when it offloads
    nothing."""
    if not offloaded(plan):
        return []
    mode = plan.model.get("offload", "auto")
    lines = []
    for s in plan.stages:
        if not s.offload.any:
            continue
        if mode == "auto":
            without = plan.with_(stages=tuple(replace(x, offload=Offload()) for x in plan.stages))
            need = without.gpu_memory(s.gpu)
            why = (
                f"GPU {s.gpu} would need {size(need)} of its {size(plan.memory_bytes)} without "
                f"offload, {size(plan.gpu_memory(s.gpu))} with it"
            )
        else:
            why = f"--offload {mode}"
        summed = " (its gradients summed on the GPU, sent once a step)" * s.offload.sums_on_device
        summed += " (each step landing at its next: --offload-step lagged)" * s.offload.lagged
        lines.append(f"stage {s.id} (GPU {s.gpu}) offloads its {s.offload.words()}{summed}: {why}")
    held = host_memory(plan)
    nodes = ", ".join(f"node {n}: {size(b)}" for n, b in sorted(held.items()) if b)
    lines.append(f"host memory: {nodes} of {size(plan.host.memory_bytes)} each")
    if sim is not None and sim.nodes:
        down = sum(g.host_bytes_down for g in sim.gpus)
        up = sum(g.host_bytes_up for g in sim.gpus)
        cpu = max(g.cpu_step_s for g in sim.gpus)
        step = f"; CPU optimizer step up to {cpu:.3g} s per GPU" if cpu else ""
        share = f", {hidden:.0%} of it hidden by the schedule" if cpu and hidden is not None else ""
        lines.append(
            f"host traffic per step: {size(down)} to the host, {size(up)} back (all GPUs)"
            f"{step}{share}"
        )
        lines += _slower_than_needed(plan, sim, cpu, hidden, lagged_s)
    return lines


# An exposed CPU step under this share of the step is not worth a line.
EXPOSED_SHARE = 0.2


def _slower_than_needed(plan: Plan, sim: SimResult, cpu: float, hidden, lagged_s) -> list[str]:
    """Where the planner offloaded because nothing else fit (`--offload auto`) and the CPU
    step it could not hide is a large part of the step: what it costs, and the options that
    train without offload, with other numerics (their memory: `--offload none`'s message)."""
    if plan.model.get("offload", "auto") != "auto" or hidden is None or not cpu:
        return []
    exposed = cpu * (1 - hidden)
    if exposed < EXPOSED_SHARE * sim.step_time_s:
        return []
    lag = (
        f"; --offload-step lagged makes it {lagged_s:.3g} s (each offloaded stage's actions "
        "read its weights one step older)"
        if lagged_s is not None
        else ""
    )
    options = [] if plan.model.get("precision") == "bf16-pure" else ["--dtype bf16-pure"]
    options += [] if plan.model.get("lora") else ["--lora"]
    tail = (
        f"; {' or '.join(options)} may train without offload, with other numerics "
        "(`--offload none` says what they need)"
        if options
        else ""
    )
    return [
        f"offload costs time: about {exposed:.3g} s of each {sim.step_time_s:.3g} s step is the "
        f"CPU optimizer step, which no GPU's work hides{lag}{tail}"
    ]
