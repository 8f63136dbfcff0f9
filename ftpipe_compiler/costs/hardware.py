"""Hardware specs (`configs/hardware/*.json`) and the roofline that turns work into time."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace

from ..errors import FtpipeError, unknown
from ..resources import config_names, load_config
from .formulas import MemoryReserve
from .host import Host


@dataclass(frozen=True)
class Hardware:
    name: str
    memory_bytes: int
    peak_flops: float  # fp32 on the plain (non-tensor-core) units
    memory_bandwidth: float  # bytes/s
    link_bandwidth: float  # bytes/s between two devices
    efficiency: float = 0.5  # fraction of peak that real kernels reach
    kernel_overhead_s: float = 0.0
    description: str = ""
    # (dtype, FLOP/s): dense tensor-core peaks of 16-bit math (fp32 accumulate)
    peak_flops_16bit: tuple[tuple[str, float], ...] = ()
    # The fixed cost of one point-to-point message between two devices (seconds), beside
    # link_bandwidth; measured per machine where a file says so (python -m benchmarks.calibrate).
    link_latency_s: float = 0.0
    # Bytes/s an optimizer step streams (each parameter's weights, gradient and optimizer
    # state read and written once: formulas.optimizer_step_s) for a parameter whose step
    # does not fit in `cache_bytes`, and for one that does; 0: the roofline's memory bandwidth.
    optimizer_bandwidth: float = 0.0
    optimizer_cache_bandwidth: float = 0.0
    cache_bytes: int = 0  # the last-level cache a parameter's step may stay in
    # fp32 products on TF32 tensor cores (Ampere and later; dense): what a run with --tf32,
    # its default (ftpipe_runtime.job.device), reaches in fp32; 0: the GPU has no TF32.
    peak_flops_tf32: float = 0.0
    tf32: bool = True  # the run lets fp32 products use TF32 (its --tf32, default on)
    # What the device holds besides a run's tensors: context, communicators, fragmentation.
    memory_reserve: MemoryReserve = MemoryReserve()
    # The node's host memory, its GPUs' link to it and its CPUs' optimizer step (`host`
    # section, defaults filled in: costs/host.py): what offloading costs.
    host: Host = Host()

    def step_bandwidth(self, held_bytes: int) -> float:
        """What the optimizer step of a parameter holding `held_bytes` (weights, gradient,
        state) streams per second: measured, in cache or not, or the roofline's."""
        if self.optimizer_cache_bandwidth and held_bytes <= self.cache_bytes:
            return self.optimizer_cache_bandwidth
        return self.optimizer_bandwidth or self.memory_bandwidth * self.efficiency

    def peak(self, dtype: str = "float32") -> float:
        """Peak FLOP/s of math in `dtype` (an op computing in bf16 runs on bf16 tensor cores;
        one in fp32 on TF32 tensor cores where the GPU has them and the run allows them)."""
        return dict(self.peak_flops_16bit).get(dtype, self.fp32_peak())

    def fp32_peak(self) -> float:
        """The fp32 rate the run will use: TF32's with --tf32 (the runtime's default) on a GPU
        that has it, else the plain fp32 units'."""
        return self.peak_flops_tf32 if self.tf32 and self.peak_flops_tf32 else self.peak_flops

    def op_time(self, flops: float, bytes_moved: float, dtype: str = "float32") -> float:
        """Roofline time of one kernel: compute- or memory-bound, whichever is slower."""
        if flops == 0 and bytes_moved == 0:
            return 0.0
        compute = flops / (self.peak(dtype) * self.efficiency)
        memory = bytes_moved / (self.memory_bandwidth * self.efficiency)
        return max(compute, memory) + self.kernel_overhead_s

    def to_json(self) -> dict:
        return asdict(self) | {"peak_flops_16bit": dict(self.peak_flops_16bit)}

    @classmethod
    def from_json(cls, d: dict) -> Hardware:
        """A hardware description (a configs/hardware file, or a cluster file's `gpu`); a
        missing or non-positive figure is one sentence."""
        if not isinstance(d, dict):
            raise FtpipeError(f"a hardware description must be a JSON object, not {d!r:.60}")
        need = ("name", "memory_bytes", "peak_flops", "memory_bandwidth", "link_bandwidth")
        figures = [
            k for k in need[1:] if not (_number(d.get(k)) and math.isfinite(d[k]) and d[k] > 0)
        ]
        if not isinstance(d.get("name"), str) or figures:
            raise FtpipeError(
                f"hardware {d.get('name', '')!r}: {', '.join(need)} are required, the numbers "
                f"finite and positive ({', '.join(figures) or 'name'} is not)"
            )
        given, d = d, {k: d[k] for k in cls.__dataclass_fields__ if k in d}
        try:
            d["peak_flops_16bit"] = tuple(sorted(dict(d.get("peak_flops_16bit") or {}).items()))
        except (TypeError, ValueError):
            raise FtpipeError(
                f"hardware {d['name']!r}: peak_flops_16bit maps dtypes to FLOP/s"
            ) from None
        reserve = d.get("memory_reserve") or {}
        fields = MemoryReserve.__dataclass_fields__
        d["memory_reserve"] = MemoryReserve(**{k: v for k, v in reserve.items() if k in fields})
        host = given.get("host") or {}
        per_node = host.get("gpus_per_node") or (given.get("node") or {}).get("gpus") or 1
        try:
            d["host"] = Host.of(host, d["memory_bytes"], per_node)
        except ValueError as e:
            raise FtpipeError(f"hardware {d['name']!r}: {e}") from None
        return cls(**d)


def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def get_hardware(name: str, *, tf32: bool = True) -> Hardware:
    """The hardware file `name`, costed for a run with TF32 on (`tf32`, the runtime's
    default --tf32) or off (--no-tf32)."""
    d = load_config("hardware", name)
    if d is None:
        raise unknown("hardware", name, config_names("hardware"))
    return replace(Hardware.from_json(d), tf32=tf32)
