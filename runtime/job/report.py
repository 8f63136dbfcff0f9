"""What a run tells its user: per-step figures on rank 0, memory of every rank.

progress = Progress(enabled=rank == 0, steps=100, first=0, samples_per_step=32)
progress.loss(step, loss_shares)   # logs "step 3/100  loss 4.1234  lr ... eta ..."
progress.grad_norm(step, squared_norm)        # where the run computed the global norm
progress.close()

A step's figures (`Progress.figures`): loss, learning rate, gradient norm (before clipping;
only where the step computes the norm over the whole pipeline: a synchronous schedule
that clips, or fp16's overflow check; otherwise left out rather than computed for the log),
tokens/s (the input positions, padding included), samples/s, rank 0's peak memory, the time
left, and on a GPU the model FLOPs utilisation (MFU: the plan's FLOPs per step, forward
and backward without recompute, against the compiled hardware's peak for the run's dtype
on every GPU). Every step goes to the run's log (`runlog.RunLog`: log.jsonl, TensorBoard,
W&B); a line is logged (`logs`) every `log_every` steps, and a progress bar is drawn only
when stderr is a terminal.

A step's losses (and its norm) may come as GPU tensors: they are copied to pinned host
memory without waiting and read once the GPU has made them (at a later step's losses, or at
`close`), so reporting never stalls the rank that queues the GPU's work.
"""

from __future__ import annotations

import collections
import datetime
import logging
import math
import sys
import threading
from dataclasses import dataclass

import torch
from tqdm import tqdm

from ..errors import PipelineConfigError
from .logs import LOGGER

__all__ = [
    "Progress",
    "Rates",
    "checksums",
    "human_bytes",
]


@dataclass(frozen=True)
class Rates:
    """What turns a step's time into rates: its tokens, FLOPs, and the peak FLOP/s of all
    the run's GPUs (0: no MFU, as on a CPU)."""

    tokens_per_step: int = 0
    flops_per_step: float = 0.0
    peak_flops: float = 0.0


def _diverged(step: int, loss: float) -> None:
    """Stop the run at a loss that is not a number (as Megatron-LM does by default): every step
    after it would train on weights no longer finite, and each checkpoint would keep them. In
    the main thread an exception (the run's own stop tells the other ranks); in rank 0's
    listener, which hears the loss rank, `liveness.die`, which tells them too."""
    why = (
        f"the loss of step {step + 1} is {loss} (weights, a gradient or the data are no longer "
        "finite numbers); the run stops here: lower --lr, check the weights the run starts "
        f"from, or resume from a checkpoint before step {step} (the one of step {step} may "
        "hold such weights already)"
    )
    if threading.current_thread() is threading.main_thread():
        raise PipelineConfigError(why)
    from .liveness import die

    die(why, 1)


class Progress:
    def __init__(
        self,
        enabled: bool,
        steps: int,
        first: int,
        samples_per_step: int,
        log_every: int = 1,
        *,
        rates: Rates = Rates(),
        memory=None,
        norms: bool = False,
        bar: bool = True,
    ):
        """`memory`: () -> this rank's peak bytes; `norms`: every step's gradient norm comes
        (`grad_norm`), so a step is reported once it has its norm too; `bar`: draw one on a
        terminal (not under -q)."""
        self.enabled, self.steps, self.first = enabled, steps, first
        self.samples_per_step, self.log_every = samples_per_step, max(1, log_every)
        self.rates, self.memory, self.expect_norms = rates, memory, norms
        self.log = None  # a RunLog: JSON lines, TensorBoard, W&B
        self.lr_of = None  # step -> learning rate, for the log
        self.logger = logging.getLogger(LOGGER)
        self.losses: dict[int, float] = {}
        self.norms: dict[int, tuple] = {}  # step -> (squared norm on the host, CUDA event)
        self.evals: dict[int, dict] = {}  # step -> {"loss", "perplexity", "samples"}
        self.times: dict[int, float] = {}  # seconds from the start to each step's end
        self.bar = None
        self.pending = collections.deque()  # (step, host tensor, CUDA event or None)
        self.lock = threading.Lock()  # the loss rank's thread and rank 0's listener both report
        if enabled and bar and sys.stderr.isatty():
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
            self.pending.append((step, *_to_host(message)))
            self.drain(wait=False)

    def grad_norm(self, step: int, squared: torch.Tensor) -> None:
        """The step's squared gradient norm over the whole pipeline (before clipping)."""
        if not self.enabled:
            return
        with self.lock:
            self.norms[step] = _to_host(squared.detach().reshape(1).clone())
            self.drain(wait=False)

    def drain(self, wait: bool = True) -> None:
        """Report the steps whose losses (and norm) are on the host by now, in order (all of
        them: `wait`)."""
        while self.pending:
            step, message, ready = self.pending[0]
            if not wait and self.expect_norms and step not in self.norms:
                return
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
        if not math.isfinite(self.losses[step]):
            _diverged(step, self.losses[step])
        if not self.enabled:
            return
        figures = self.figures(step)
        if self.log is not None:
            self.log.record("train", step + 1, **figures)
        if self.bar is not None:
            self.bar.update(1)
            self.bar.set_postfix(loss=f"{self.losses[step]:.4f}")
        if (step + 1) % self.log_every == 0 or step in (self.first, self.steps - 1):
            self.write(f"step {step + 1}/{self.steps}  " + step_line(figures))

    def figures(self, step: int) -> dict:
        """What the log says of `step`: the keys of `step_line` (those the run has)."""
        out = {"loss": self.losses[step]}
        if self.lr_of is not None:
            out["lr"] = self.lr_of(step)
        norm = self.norms.pop(step, None)
        if norm is not None:
            squared, ready = norm
            if ready is not None:
                ready.synchronize()
            out["grad_norm"] = float(squared.double().sqrt())
        rate = self.samples_per_s()
        out["samples_per_s"] = rate
        if self.rates.tokens_per_step:
            out["tokens_per_s"] = rate / self.samples_per_step * self.rates.tokens_per_step
        if self.memory is not None:
            out["peak_memory_bytes"] = int(self.memory())
        done = step - self.first + 1
        out["eta_s"] = (self.steps - step - 1) * self.times[step] / max(done, 1)
        if self.rates.flops_per_step and self.rates.peak_flops:
            steps_per_s = rate / self.samples_per_step
            out["mfu"] = self.rates.flops_per_step * steps_per_s / self.rates.peak_flops
        out["time_s"] = self.times[step]
        return out

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

    def write(self, line: str, level: int = logging.INFO) -> None:
        """A line of rank 0's log (`logs`: time and rank before it; below a bar's line)."""
        self.logger.log(level, line)

    def close(self) -> None:
        with self.lock:
            self.drain(wait=True)
        if self.bar is not None:
            self.bar.close()


def step_line(figures: dict) -> str:
    """`loss 4.1234  lr 1.00e-03  grad_norm 0.981  2,048 tokens/s  32.0 samples/s  mem 1.2
    GiB  eta 0:01:05  mfu 41.2%`: the figures the step has, two spaces apart."""
    f = figures
    parts = [f"loss {f['loss']:.4f}"]
    if "lr" in f:
        parts.append(f"lr {f['lr']:.3e}")
    if "grad_norm" in f:
        parts.append(f"grad_norm {f['grad_norm']:.4g}")
    if "tokens_per_s" in f:
        parts.append(f"{f['tokens_per_s']:,.0f} tokens/s")
    parts.append(f"{f['samples_per_s']:.1f} samples/s")
    if "peak_memory_bytes" in f:
        parts.append(f"mem {human_bytes(f['peak_memory_bytes'])}")
    parts.append(f"eta {datetime.timedelta(seconds=round(f['eta_s']))}")
    if "mfu" in f:
        parts.append(f"mfu {100 * f['mfu']:.1f}%")
    return "  ".join(parts)


def _to_host(t: torch.Tensor) -> tuple[torch.Tensor, object]:
    """(`t` on the host, a CUDA event to wait for before reading it, or None)."""
    if t.device.type != "cuda":
        return t, None
    with torch.cuda.device(t.device):
        host = torch.empty(t.shape, dtype=torch.float64, pin_memory=True)
        host.copy_(t, non_blocking=True)
        ready = torch.cuda.Event()
        ready.record()
    return host, ready


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
