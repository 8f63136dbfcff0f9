"""What a run tells its user: per-step loss and throughput on rank 0, memory of every rank.

progress = Progress(enabled=rank == 0, steps=100, first=0, samples_per_step=32)
progress.loss(step, loss_shares)   # logs "step 3/100  loss 4.1234  812 samples/s"
progress.close()
memory_meter("cpu").peaks()                   # {"allocated": bytes, "reserved": bytes}

A progress bar only when stderr is a terminal; otherwise (a log file, a CI job, torchrun's
captured output) a plain line every `log_every` steps and nothing else.

A step's losses may come as a GPU tensor: they are copied to pinned host memory without
waiting and read once the GPU has made them (at a later step's losses, or at `close`), so
reporting a loss never stalls the rank that queues the GPU's work.
"""

from __future__ import annotations

import collections
import functools
import resource
import sys
import threading

import torch
from tqdm import tqdm

__all__ = ["Memory", "Progress", "checksums", "human_bytes", "memory_meter", "resident_bytes"]


class Progress:
    def __init__(
        self, enabled: bool, steps: int, first: int, samples_per_step: int, log_every: int = 1
    ):
        self.enabled, self.steps, self.first = enabled, steps, first
        self.samples_per_step, self.log_every = samples_per_step, max(1, log_every)
        self.log = None  # a RunLog: JSON lines and TensorBoard scalars
        self.lr_of = None  # step -> learning rate, for the log
        self.losses: dict[int, float] = {}
        self.evals: dict[int, dict] = {}  # step -> {"loss", "perplexity", "samples"}
        self.times: dict[int, float] = {}  # seconds from the start to each step's end
        self.bar = None
        self.pending = collections.deque()  # (step, host tensor, CUDA event or None)
        self.lock = threading.Lock()  # the loss rank's thread and rank 0's listener both report
        if enabled and sys.stderr.isatty():
            self.bar = tqdm(
                total=steps - first,
                desc="steps",
                unit="step",
                file=sys.stderr,
                dynamic_ncols=True,
                leave=False,
            )

    def loss(self, step: int, message: torch.Tensor) -> None:
        """`message`: the step's micro-batches' shares of its loss, then seconds since
        training started; on a GPU, read when it is there (in step order: `drain`)."""
        with self.lock:
            ready = None
            if message.device.type == "cuda":
                with torch.cuda.device(message.device):
                    host = torch.empty(message.shape, dtype=torch.float64, pin_memory=True)
                    host.copy_(message, non_blocking=True)
                    ready = torch.cuda.Event()
                    ready.record()
                message = host
            self.pending.append((step, message, ready))
            self.drain(wait=False)

    def drain(self, wait: bool = True) -> None:
        """Report the losses that are on the host by now, in order (all of them: `wait`)."""
        while self.pending:
            step, message, ready = self.pending[0]
            if ready is not None and not wait and not ready.query():
                return
            if ready is not None:
                ready.synchronize()
            self.pending.popleft()
            self._report(step, message)

    def _report(self, step: int, message: torch.Tensor) -> None:
        message = message.double().cpu()
        # each micro-batch's share of the step's loss (of every replica's): their sum
        self.losses[step] = float(message[:-1].sum())
        self.times[step] = float(message[-1])
        if not self.enabled:
            return
        if self.log is not None:
            lr = self.lr_of(step) if self.lr_of is not None else None
            self.log.record("train", step + 1, loss=self.losses[step], lr=lr,
                            samples_per_s=self.samples_per_s(), time_s=self.times[step])  # fmt: skip
        if self.bar is not None:
            self.bar.update(1)
            self.bar.set_postfix(loss=f"{self.losses[step]:.4f}")
        if (step + 1) % self.log_every == 0 or step in (self.first, self.steps - 1):
            self.write(
                f"step {step + 1}/{self.steps}  loss {self.losses[step]:.4f}  "
                f"{self.samples_per_s():.1f} samples/s"
            )

    def evaluated(self, step: int, loss: float, ppl: float | None, samples: int) -> None:
        """An evaluation after `step` steps: its mean loss (and perplexity) over `samples`."""
        self.evals[step] = {"loss": loss, "perplexity": ppl, "samples": samples}
        if not self.enabled:
            return
        more = f", perplexity {ppl:.2f}" if ppl is not None else ""
        self.write(f"eval after step {step}: loss {loss:.4f}{more} ({samples} samples)")
        if self.log is not None:
            self.log.record("eval", step, loss=loss, perplexity=ppl, samples=samples)

    def samples_per_s(self) -> float:
        """Samples of finished steps over the time since training started (pipeline fill too)."""
        if not self.times:
            return 0.0
        return len(self.times) * self.samples_per_step / max(max(self.times.values()), 1e-9)

    def steady_samples_per_s(self) -> float:
        """The same, from the first finished step on: without the pipeline's fill."""
        if len(self.times) < 2:
            return self.samples_per_s()
        t = sorted(self.times.values())
        return (len(t) - 1) * self.samples_per_step / max(t[-1] - t[0], 1e-9)

    def write(self, line: str) -> None:
        if self.bar is not None:
            self.bar.write(line, file=sys.stderr)
        else:
            print(line, file=sys.stderr, flush=True)

    def close(self) -> None:
        with self.lock:
            self.drain(wait=True)
        if self.bar is not None:
            self.bar.close()


class Memory:
    """This rank's peak memory, as the plan counts it ("allocated") and as the device sees
    it ("reserved"), in bytes:

        memory = Memory(device)        # before any stage is built
        memory.peaks()                 # {"allocated": ..., "reserved": ...}

    On CUDA, torch's caching allocator says both: the peak of live tensors and of what it
    holds from the driver (tensors plus its cache and fragmentation). On the CPU no
    allocator counts tensors, so the process's resident set does: "reserved" is its peak
    (the interpreter and libraries included), "allocated" that peak less the resident set
    when this meter started, before any stage was built: what the run's stages, optimizer
    state, activations and messages added, the figure a plan's memory model predicts. Torch
    loads much of itself only when first asked (the first optimizer imports torch._dynamo:
    ~70 MB resident; the first matrix product, backward and step ~15 MB more), so the meter
    asks first and starts after: those are the process's, not the run's."""

    def __init__(self, device):
        self.device = torch.device(device)
        if self.device.type == "cuda":
            self.baseline = 0
            return
        _load_lazy_parts()
        self.baseline = resident_bytes()

    def peaks(self) -> dict[str, int]:
        if self.device.type == "cuda":
            return {
                "allocated": int(torch.cuda.max_memory_allocated(self.device)),
                "reserved": int(torch.cuda.max_memory_reserved(self.device)),
            }
        peak = peak_resident_bytes()
        return {"allocated": max(0, peak - self.baseline), "reserved": peak}


def _load_lazy_parts() -> None:
    """One tiny training step: what torch loads on first use is loaded now."""
    from ..train.optim import make_optimizer

    w = torch.nn.Parameter(torch.zeros(8, 8))
    optimizer = make_optimizer("adamw", [w], 1e-3)
    x = torch.ones(2, 8)
    torch.nn.functional.cross_entropy(x @ w, torch.zeros(2, dtype=torch.long)).backward()
    optimizer.step()


@functools.cache
def memory_meter(device: str) -> Memory:
    """This process's meter for `device`, started at the first call: a run makes it before
    its first stage is built (`prepare.prepare_rank`); a later plan's stages (freeze
    training) count from the same start."""
    return Memory(device)


def resident_bytes() -> int:
    """The process's resident set now (Linux: /proc; elsewhere its peak so far)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * resource.getpagesize()
    except (OSError, ValueError, IndexError):
        return peak_resident_bytes()


def peak_resident_bytes() -> int:
    """The process's peak resident set (getrusage: KiB on Linux, bytes on macOS)."""
    peak = int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
    return peak if sys.platform == "darwin" else peak * 1024


CHECKSUM_CHUNK = 2**20  # elements: the float64 copy a checksum makes at a time (8 MiB)


def checksums(modules: dict, chunk: int = CHECKSUM_CHUNK) -> dict[str, list[float]]:
    """[sum, sum of squares] of every parameter (each lives in exactly one stage), in float64.
    A chunk at a time: the run ends with the optimizer state still alive, and a float64 copy
    of a whole 128k-vocabulary embedding (and of its square) would be GBs more at the peak;
    each chunk's sums are added up in float64 on the parameter's device (one sync each)."""
    out = {}
    for module in modules.values():
        for name, p in module.named_parameters():
            sums = torch.zeros(2, dtype=torch.float64, device=p.device)
            for part in p.detach().reshape(-1).split(chunk):
                x = part.double()
                sums[0] += x.sum()
                sums[1] += torch.dot(x, x)  # no temporary for the squares
                del x  # before the next chunk's copy is made: one at a time
            out[name] = sums.tolist()
    return out


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"
