"""Optimizer offload (`--offload-optimizer`): a stage's master weights and optimizer state in
host memory, its optimizer step on the CPU.

    host = HostOffload(device)                       # this rank's device
    mixed = MixedPrecision(precision, modules, offload=host)
    # masters: host copies of the trainable weights (pinned on CUDA), what the optimizer steps
    host.arrive(stage, master, g)   # a gradient made on the device: to the host, summed there
    host.settle(stage)              # at the stage's S: every copy landed, its .grad complete
    host.upload(stage, pairs)       # after the CPU step: the new weights back to the device
    host.launch(stage, opt.step, pairs)  # or: the CPU step on the host's thread, the rank goes on
    host.land(stage)                # before the stage's weights are next read: waited for, uploaded
    HostOffload(device, on_device={1})   # stage 1's gradients summed on the device (below)
    host.clock.seconds                   # where the rank's time went, by phase (`PHASES`)

Every trainable weight gets a master on the host, a copy distinct from the weight even in fp32
(fp32 under mixed precision, else the weight's dtype), so the optimizer's state, which it
makes like its parameters, is on the host too and the device keeps only the weights it
computes with. Each gradient goes to the host as the backward produces it (the weight's own
`.grad` freed at once), into a host buffer in the gradient's dtype (a 16-bit gradient crosses
the link in 16 bits), and is summed into the master's fp32 `.grad` on the host: the same
additions, in the same order, as the device sums them without offload, so the step is the same.

On CUDA the copy is asynchronous (pinned buffer, `non_blocking`): the sum on the host waits
for it only when the same weight's next gradient needs the buffer, or at the stage's step
(`settle`). The weights go back the same way after the step; the next step of the stage
waits for that copy before it changes the masters again. On the CPU the copies are plain
copies into distinct host tensors: the same code path, nothing to wait for.

Host memory per trainable element: the master (4 bytes under mixed precision), the optimizer's
state (AdamW: 8), the summed gradient (4) and the landing buffer (the gradient's dtype: 2 in
bf16); the device keeps the weight and, briefly, each gradient until its copy is issued.

Overlapped (`launch`, `land`): the CPU step runs on one worker thread of the rank while its
thread goes on with actions that do not read the stage's weights (other stages' actions, the
wait for a micro-batch's inputs, and, under a schedule that runs on set-aside weight versions
(PipeDream-2BW, WPipe), the stage's own actions on the older version: up to a whole step).
The new weights go to the device when the stage's weights are next read (`land`: its next
forward, or backward recomputing one, on the weights themselves, a copy of them set aside,
its next step, a checkpoint), which is where the step without overlap would have left them:
the same weights reach the same actions, so the run is the same, bit for bit. A `lagged`
stage's step lands at its next S instead (`--offload-step lagged`, FTPipe's schedule): its
actions until then read the weights one step older, a rule of its own (the tests' reference:
`train_stale` with `lag=1`), and the whole CPU step overlaps them; its checkpoint keeps
those older weights beside the masters (`defer` puts them back on resume). Meanwhile the
stage's next gradients are summed apart (the step reads the masters' `.grad`) and become the
`.grad` at `land`: the same additions in the same order. The thread converts the new weights
into staging buffers of their own (the landing buffers are busy with the next gradients):
host memory per element, streamed, +2 in bf16, and +4 for the second sum where a backward
can come before the step lands (2BW's and WPipe's on the older version, a lagged stage's;
not FTPipe's nor a flush's: `costs.host.sums_apart`).

A stage in `on_device` (the plan's `offload.gradients == "device"`) streams nothing during its
backwards: its gradients sum on the device, in the master's dtype, into an accumulator per
weight (allocated once, reused every step) — the first copied in, the next added, the same
operations in the same order as `add_grad` makes them into a master kept on the device, so
the step is bit for bit the one without offload — and `settle` copies each sum once to the
host, into a landing tensor that becomes the master's `.grad` (pinned on CUDA, reused: a
stage's gradients set aside at its S are stepped before its next S). Per step the link then
carries 4 bytes an element down (mixed precision) instead of the micro-batches' gradients,
m x 2 bytes in bf16, and the host sums nothing; the device holds the sums (4 bytes an
element), the host the masters, the optimizer state and the landed sums (no 16-bit buffer).
"""

from __future__ import annotations

import contextlib
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import torch

from .precision import add_grad, add_into

__all__ = ["PHASES", "Clock", "HostOffload", "may_lag"]

# The rank thread's seconds by phase, which the simulator's host model predicts one by one
# (`ftpipe_compiler.costs.host.optimizer_times`); on CUDA a wait is the time until the copy
# or the compute before it is done, so the GPU-side split is visible from the host.
PHASES = {
    "to_host": "gradient copies issued to the host (on the CPU: made)",
    "copy_wait": "waits for a gradient's copy to land",
    "host_sums": "gradients added into the fp32 sums on the host",
    "backward_wait": "at the step, waits for the device's queued work (GPU sums)",
    "sum_copies": "the device's gradient sums copied to the host (GPU sums)",
    "cpu_step": "the optimizer step on the CPU (overlapped: on the host's thread)",
    "step_wait": "waits for an overlapped CPU step, where the stage's weights are next read",
    "to_device": "new weights' copies issued to the device",
    "upload_wait": "waits for the previous step's weights to reach the device",
}


def may_lag(policy) -> bool:
    """Can a stage under this schedule policy (`schedules.StagePolicy`) take lagged steps?
    Only where its actions read the weights as they are (FTPipe's: no pinned version); a
    flush needs the newest weights at its next forward, and a versioned schedule (2BW,
    WPipe) already overlaps a whole step exactly."""
    return policy.weight_delay is None


class Clock:
    """Seconds this rank's thread spent in each phase, summed over the run.

    clock = Clock(); with clock.phase("cpu_step"): optimizer.step()
    """

    def __init__(self):
        self.seconds = dict.fromkeys(PHASES, 0.0)
        self._lock = threading.Lock()  # the rank's thread and the CPU step's both add

    @contextlib.contextmanager
    def phase(self, name: str):
        t0 = time.perf_counter()
        try:
            yield
        finally:
            with self._lock:
                self.seconds[name] += time.perf_counter() - t0


class HostOffload:
    """The host side of this rank's stages' masters (see the module doc)."""

    def __init__(self, device, *, on_device=()):
        self.device = torch.device(device)
        self.pinned = self.device.type == "cuda"
        self.on_device = frozenset(on_device)  # stages whose gradients sum on the device
        self._sums: dict[int, torch.Tensor] = {}  # id(master) -> its sum on the device
        self._landed: dict[int, torch.Tensor] = {}  # id(master) -> the sum's host copy
        self._summing: dict[int, dict[int, torch.Tensor]] = {}  # stage -> id -> master, this step
        self._buffers: dict[int, torch.Tensor] = {}  # id(master) -> its gradient's landing
        self._pending: dict[int, dict[int, tuple]] = {}  # stage -> id(master) -> copy in flight
        self._uploads: dict[int, torch.cuda.Event] = {}  # stage -> its weights' copy back
        self._staging: dict[int, torch.Tensor] = {}  # id(master) -> new weight, overlapped
        self._inflight: dict[int, object] = {}  # stage -> its overlapped step's Future
        self._ready: dict[int, list] = {}  # stage -> its stepped weights, staged, not landed
        # stages whose steps land at their next S, not where their weights are next read
        self.lagged: frozenset[int] = frozenset()
        self._next: dict[int, dict[int, tuple]] = {}  # stage -> id -> (master, sum) meanwhile
        self._worker: ThreadPoolExecutor | None = None
        self.clock = Clock()

    def master_of(self, weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """A host copy of `weight` in `dtype` (pinned on CUDA), what the optimizer steps."""
        host = torch.empty(weight.shape, dtype=dtype, device="cpu", pin_memory=self.pinned)
        host.copy_(weight.detach())
        return host.requires_grad_(True)

    def arrive(self, stage: int, master: torch.Tensor, g: torch.Tensor) -> None:
        """A gradient `g` (on the device) of the weight whose master is `master`."""
        key = id(master)
        if stage in self.on_device:
            self._sum(stage, master, g)
            return
        pending = self._pending.setdefault(stage, {})
        if key in pending:  # its buffer is about to be reused: sum what it holds first
            self._sum_landed(stage, *pending.pop(key))
        buf = self._buffers.get(key)
        if buf is None or buf.dtype != g.dtype:
            buf = torch.empty(g.shape, dtype=g.dtype, device="cpu", pin_memory=self.pinned)
            self._buffers[key] = buf
        if not self.pinned:
            with self.clock.phase("to_host"):
                buf.copy_(g)
            with self.clock.phase("host_sums"):
                self._add(stage, master, buf)
            return
        with self.clock.phase("to_host"):
            buf.copy_(g, non_blocking=True)
            done = torch.cuda.Event()
            done.record()
        pending[key] = (master, buf, done)

    def settle(self, stage: int) -> None:
        """Before the stage's step: its gradients summed on the host, and its last weights'
        copy back to the device done (the step changes the masters it reads). Summed on the
        device: each sum copied once into its master's `.grad`, waited for."""
        for master, buf, done in self._pending.pop(stage, {}).values():
            self._sum_landed(stage, master, buf, done)
        summing = self._summing.pop(stage, {})
        if summing:
            self._copy_sums(summing)
        upload = self._uploads.pop(stage, None)
        if upload is not None:
            with self.clock.phase("upload_wait"):
                upload.synchronize()

    def _copy_sums(self, summing: dict[int, torch.Tensor]) -> None:
        """Each device sum once into its master's `.grad` on the host, waited for (first the
        backwards still queued, timed apart from the copies)."""
        stream = torch.cuda.current_stream(self.device) if self.pinned else None
        if stream is not None:
            with self.clock.phase("backward_wait"):
                stream.synchronize()
        with self.clock.phase("sum_copies"):
            for key, master in summing.items():
                landed = self._landed.get(key)
                if landed is None:
                    landed = torch.empty(
                        master.shape, dtype=master.dtype, device="cpu", pin_memory=self.pinned
                    )
                    self._landed[key] = landed
                landed.copy_(self._sums[key], non_blocking=self.pinned)
                master.grad = landed
            if stream is not None:
                stream.synchronize()

    @torch.no_grad()
    def upload(self, stage: int, pairs) -> None:
        """(weight, master) pairs: the stepped masters into the device's weights."""
        self._copy_up(stage, ((w, self._staged(w, master, self._buffers)) for w, master in pairs))

    def _copy_up(self, stage: int, staged) -> None:
        """(weight, new value on the host) pairs into the device's weights, asynchronously
        on CUDA (the copy's event kept: `settle` waits for it before the next step)."""
        with self.clock.phase("to_device"):
            for weight, new in staged:
                weight.copy_(new, non_blocking=self.pinned)
            if self.pinned:
                done = torch.cuda.Event()
                done.record()
                self._uploads[stage] = done

    def _staged(self, weight: torch.Tensor, master: torch.Tensor, held: dict) -> torch.Tensor:
        """The master to copy into `weight`, converted to the weight's dtype here into a host
        buffer (pinned on CUDA), so that the copy back is the link's alone and asynchronous.
        Copied as it is, a pinned fp32 master into a bf16 weight is converted by torch on the
        CPU into a fresh pageable tensor and copied from that synchronously (ATen's
        `copy_kernel_cuda`): the weights' bytes allocated, faulted in and waited for every
        step. A streamed stage's landing buffer (the weight's dtype and shape, idle after
        `settle`) is reused; a stage summing on the device gets one of its own (2 bytes an
        element in bf16: `costs.host.host_param_bytes`). CPU ranks take the same path.
        `held`: the buffers to reuse (`_buffers`; an overlapped step's `_staging`, its own:
        the landing buffers take the next step's gradients while it waits to be copied)."""
        if master.dtype == weight.dtype:
            return master
        key = id(master)
        buf = held.get(key)
        if buf is None or buf.dtype != weight.dtype:
            buf = torch.empty(
                weight.shape, dtype=weight.dtype, device="cpu", pin_memory=self.pinned
            )
            held[key] = buf
        buf.copy_(master)  # the conversion, on the CPU's threads
        return buf

    def launch(self, stage: int, step, pairs) -> None:
        """`step()` (the optimizer's, reading the masters' `.grad`) on the host's thread, then
        the (weight, master) `pairs`' new weights staged for the device; the rank goes on
        until `land`. The gradients are spent there (`.grad` None after the step)."""

        def work():
            with self.clock.phase("cpu_step"):
                step()
            with self.clock.phase("to_device"):
                staged = [(w, self._staged(w, master, self._staging)) for w, master in pairs]
            for _, master in pairs:
                master.grad = None
            return staged

        if self._worker is None:
            self._worker = ThreadPoolExecutor(1, thread_name_prefix="ftpipe-cpu-step")
        self._inflight[stage] = self._worker.submit(work)

    def pending(self, stage: int) -> bool:
        """Is an overlapped step of the stage not landed yet?"""
        return stage in self._inflight or stage in self._ready

    def finish(self, stage: int) -> None:
        """The stage's overlapped step, if any, done (its masters and state may be read),
        the gradients summed meanwhile made the masters' `.grad`; its new weights wait for
        `land`. An error on the thread is raised here."""
        job = self._inflight.pop(stage, None)
        if job is None:
            return
        with self.clock.phase("step_wait"):
            self._ready[stage] = job.result()
        for master, total in self._next.pop(stage, {}).values():
            master.grad = total

    def defer(self, stage: int, pairs) -> None:
        """A resumed lagged stage: its weights the older version the checkpoint kept, the
        (weight, master) `pairs`' masters staged to land at its first step."""
        self._ready[stage] = [(w, self._staged(w, master, self._staging)) for w, master in pairs]

    @torch.no_grad()
    def land(self, stage: int, *, reading: bool = False) -> None:
        """The stage's overlapped step, if any: finished, its new weights copied to the device
        (asynchronously on CUDA: `settle` waits). `reading`: the stage's weights are about
        to be read, which a lagged stage's step does not wait for (it lands at its S)."""
        if reading and stage in self.lagged:
            return
        self.finish(stage)
        staged = self._ready.pop(stage, None)
        if staged is not None:
            self._copy_up(stage, staged)

    def land_all(self) -> None:
        for stage in {*self._inflight, *self._ready}:
            self.land(stage)

    def _add(self, stage: int, master: torch.Tensor, g: torch.Tensor) -> None:
        """`g` into the master's sum; while the stage's step is in flight (it reads `.grad`),
        into a sum apart, the same additions (`add_grad`), which `finish` makes the `.grad`."""
        if stage not in self._inflight:
            add_grad(master, g)
            return
        apart = self._next.setdefault(stage, {})
        have = apart.get(id(master))
        if have is None:
            apart[id(master)] = (master, g.to(master.dtype, copy=True))
        else:
            add_into(have[1], g)

    def forget(self, master: torch.Tensor) -> None:
        """A master that trains no more (freeze training): its buffers let go."""
        for held in (self._buffers, self._sums, self._landed, self._staging):
            held.pop(id(master), None)

    @torch.no_grad()
    def _sum(self, stage: int, master: torch.Tensor, g: torch.Tensor) -> None:
        """`g` into the master's sum on the device: copied in first (as `add_grad` copies
        the first into a fresh `.grad`), added after, in place from its own dtype."""
        key = id(master)
        summing = self._summing.setdefault(stage, {})
        if key in summing:
            add_into(self._sums[key], g)
            return
        acc = self._sums.get(key)
        if acc is None:
            acc = self._sums[key] = torch.empty(g.shape, dtype=master.dtype, device=g.device)
        acc.copy_(g)
        summing[key] = master

    def _sum_landed(self, stage: int, master: torch.Tensor, buf: torch.Tensor, done) -> None:
        with self.clock.phase("copy_wait"):
            done.synchronize()
        with self.clock.phase("host_sums"):
            self._add(stage, master, buf)
