"""What a simulation reports: throughput, bubbles, and per-GPU busy time, memory and traffic.

result = simulate(plan)             # SimResult
result.step_time_s, result.samples_per_s, result.gpus[0].peak_memory_bytes
result.summary()                    # the `ftpipe simulate --json` object
SimResult.from_json(result.to_json())
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields

from ..errors import PlanFormatError


@dataclass(frozen=True)
class GpuResult:
    gpu: int
    busy_fraction: float  # compute time / steady-state window
    # Weights, grads, optimizer state, in-flight activations, the runtime's buffers and the
    # device's reserve (`Plan.gpu_memory`).
    peak_memory_bytes: int
    memory_bytes: int  # capacity
    stages: tuple[int, ...]
    bytes_sent: int  # per step: activations, weights and their gradients
    # Offloaded stages (simulate/host.py), per step: bytes over its host link each way and
    # the CPU's optimizer steps of its stages.
    host_bytes_down: int = 0
    host_bytes_up: int = 0
    cpu_step_s: float = 0.0

    @property
    def fits(self) -> bool:
        return self.peak_memory_bytes <= self.memory_bytes

    @property
    def headroom_bytes(self) -> int:
        """Capacity left at the peak (negative: over capacity)."""
        return self.memory_bytes - self.peak_memory_bytes


@dataclass(frozen=True)
class NodeResult:
    """One node's host memory: what its ranks' offloaded stages hold, and what it has."""

    node: int
    host_bytes: int
    host_memory_bytes: int

    @property
    def fits(self) -> bool:
        return self.host_bytes <= self.host_memory_bytes


@dataclass(frozen=True)
class Event:
    """One action on the timeline; kind F, B, R (recompute + backward), W or S (step, mb =
    step); on a GPU's host link (`host.HOST_KINDS`) D, C, U (step), O or I."""

    gpu: int
    stage: int
    kind: str
    mb: int
    start: float
    end: float


@dataclass(frozen=True)
class SimResult:
    schedule: str
    micro_batches: int  # per optimizer step
    micro_batch_size: int  # samples per micro-batch
    steps: int
    # Steady state: the slowest GPU's step ends E_k; step time is the mean of E_k - E_{k-1}
    # over the last half of the steps (the whole first step when there is only one).
    step_time_s: float
    samples_per_s: float
    bubble_fraction: float  # 1 - mean busy fraction over the steady-state window
    window_s: tuple[float, float]  # the steady-state window the fractions are measured over
    step_ends_s: tuple[float, ...]  # E_k for every step
    in_flight: tuple[int, ...]  # per stage: most micro-batches held between F and B at once
    # Offloaded stages whose next gradients came while their CPU step ran: a second sum
    # held beside the step's (`costs.host.sums_apart`), counted in their GPU's peak.
    sums_apart: tuple[int, ...]
    gpus: tuple[GpuResult, ...]
    timeline: tuple[Event, ...] = ()  # the first few steps, for the report
    replicas: int = 1  # data-parallel copies of the pipeline (samples/s counts them all)
    nodes: tuple[NodeResult, ...] = ()  # host memory per node, where stages offload

    @property
    def max_memory_bytes(self) -> int:
        return max((g.peak_memory_bytes for g in self.gpus), default=0)

    @property
    def fits(self) -> bool:
        return all(g.fits for g in self.gpus) and self.host_fits

    @property
    def host_fits(self) -> bool:
        return all(n.fits for n in self.nodes)

    def summary(self) -> dict:
        """The figures `ftpipe simulate --json` prints."""
        return {
            "schedule": self.schedule,
            "replicas": self.replicas,
            "micro_batches": self.micro_batches,
            "steps": self.steps,
            "step_time_s": self.step_time_s,
            "samples_per_s": self.samples_per_s,
            "bubble_fraction": self.bubble_fraction,
            "gpus": [
                {
                    "gpu": g.gpu,
                    "busy_fraction": g.busy_fraction,
                    "peak_memory_bytes": g.peak_memory_bytes,
                    "memory_bytes": g.memory_bytes,
                    "headroom_bytes": g.headroom_bytes,
                    "stages": list(g.stages),
                    "bytes_sent": g.bytes_sent,
                    **(
                        {
                            "host_bytes_down": g.host_bytes_down,
                            "host_bytes_up": g.host_bytes_up,
                            "cpu_step_s": g.cpu_step_s,
                        }
                        if self.nodes
                        else {}
                    ),  # fmt: skip
                }
                for g in self.gpus
            ],
            **({"nodes": [asdict(n) for n in self.nodes]} if self.nodes else {}),
        }

    def to_json(self) -> dict:
        d = asdict(self)
        # A timeline holds thousands of events: rows, not objects.
        d["timeline"] = [[e.gpu, e.stage, e.kind, e.mb, e.start, e.end] for e in self.timeline]
        return d

    @classmethod
    def from_json(cls, d: dict) -> SimResult:
        try:
            later = {"gpus", "timeline", "replicas", "nodes", "sums_apart"}
            names = {f.name for f in fields(cls)} - later
            return cls(
                **{k: tuple(d[k]) if isinstance(d[k], list) else d[k] for k in names},
                replicas=d.get("replicas", 1),
                sums_apart=tuple(d.get("sums_apart", ())),  # (none before 2026-11-30)
                gpus=tuple(GpuResult(**{**g, "stages": tuple(g["stages"])}) for g in d["gpus"]),
                timeline=tuple(Event(*row) for row in d.get("timeline", ())),
                nodes=tuple(NodeResult(**n) for n in d.get("nodes", ())),
            )
        except (KeyError, TypeError) as e:
            raise PlanFormatError(
                f"the simulation result is incomplete ({e}); simulate again"
            ) from None
