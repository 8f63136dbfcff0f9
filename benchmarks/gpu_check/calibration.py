"""What a GPU check's measurements propose for a hardware file, and writing it there.

    calib = propose(parts, hardware="h100-80gb", date="2026-11-27")   # into GPU_CHECK.json
    hw = applied(json.loads(path.read_text()), calib)                  # python -m ...apply

The datasheet peaks stay (they are the vendor's, and `efficiency` scales them); measured
here and proposed:
- `efficiency`: the fraction of the peaks a real training step reaches, fitted so that the
  simulator's step for the Llama run equals the measured one: the roofline's times scale
  as 1 / efficiency, so efficiency' = efficiency x simulated / measured.
- `kernel_overhead_s`: the seconds of one tiny op (launch and dispatch).
- `optimizer_bandwidth`: what the runtime's AdamW step streams per second on the device.
- the `host` section (optimizer offload): `step_bandwidth` and `sum_bandwidth`, the GPU
  host's CPUs stepping AdamW and summing gradients (`benchmarks.host_rates`, the better of
  one thread and all cores), and `link_bandwidth`, the slower of the pinned copies each way.
The matrix, copy and host<->device rates go into the file's `calibration` record beside
them, with the date and device they were measured on.
"""

from __future__ import annotations

__all__ = ["applied", "host_rates", "propose"]


def propose(parts: list[dict], hardware: str | None, date: str) -> dict | None:
    """The proposal from a check's parts (None: nothing was measured on a GPU)."""
    by_name = {p["name"]: p for p in parts}
    rates = by_name.get("rates", {})
    if rates.get("status") not in ("passed", "failed") or "host_to_device" not in rates.get(
        "figures", {}
    ):
        return None
    r = rates["figures"]
    env = by_name.get("environment", {}).get("figures", {})
    proposed = {
        "kernel_overhead_s": float(f"{r['op_overhead_s']:.3g}"),
        "optimizer_bandwidth": float(f"{r['optimizer_bandwidth']:.3g}"),
    }
    host = host_rates(r)
    if host:
        proposed["host"] = host
    llama = by_name.get("llama", {}).get("figures", {})
    basis = "no Llama step measured: efficiency left as it is"
    if llama.get("measured_step_s") and llama.get("simulated_step_s"):
        fitted = llama["efficiency"] * llama["simulated_step_s"] / llama["measured_step_s"]
        proposed["efficiency"] = round(min(max(fitted, 0.05), 1.0), 3)
        basis = (
            f"efficiency {llama['efficiency']} x simulated {llama['simulated_step_s']:.4g} s / "
            f"measured {llama['measured_step_s']:.4g} s of the {llama.get('model')} step "
            f"({llama.get('stages')} stages on one GPU, {llama.get('dtype')})"
        )
    return {
        "hardware": hardware,
        "date": date,
        "device": env.get("gpu", {}).get("name"),
        "torch": env.get("torch"),
        "proposed": proposed,
        "measured": {
            "gemm_tflops": r["gemm_tflops"],
            "gemm_n": r["gemm_n"],
            "memory_bandwidth": r["memory_bandwidth"],
            "host_to_device": r["host_to_device"],
            "device_to_host": r["device_to_host"],
            "op_overhead_s": r["op_overhead_s"],
            "optimizer_bandwidth": r["optimizer_bandwidth"],
        },
        "basis": basis,
    }


def host_rates(rates: dict) -> dict:
    """The `host` section's measured rates (empty: the check measured no host)."""
    host = rates.get("host")
    if not host:
        return {}
    runs = [v for k, v in host.items() if k.startswith("threads_")]
    best = {k: max(r[k] for r in runs) for k in ("step_bandwidth", "sum_bandwidth")}
    link = min(rates["host_to_device"], rates["device_to_host"])
    return {k: float(f"{v:.3g}") for k, v in {**best, "link_bandwidth": link}.items()}


def applied(hw: dict, calib: dict) -> dict:
    """The hardware file `hw` with the proposal written in, the measurements kept in its
    `calibration` record and a line in its sources."""
    proposed = dict(calib["proposed"])
    host = proposed.pop("host", None)
    hw = {**hw, **proposed}
    if host:
        hw["host"] = {**hw.get("host", {}), **host}
    m = calib["measured"]
    hw["calibration"] = {k: calib[k] for k in ("date", "device", "torch", "measured", "basis")}
    g = m["gemm_tflops"]
    note = (
        f"calibrated on {calib['date']} on an {calib['device']} (torch {calib['torch']}) by "
        f"make gpu-check (python -m benchmarks.gpu_check): {m['gemm_n']}^3 products at "
        f"{g['bfloat16']:.0f} TFLOP/s bf16, {g['tf32']:.0f} TF32, {g['float32']:.0f} fp32; "
        f"copies at {m['memory_bandwidth'] / 1e12:.2f} TB/s (read + written), host to device "
        f"{m['host_to_device'] / 1e9:.1f} GB/s, back {m['device_to_host'] / 1e9:.1f} GB/s; one "
        f"small op {m['op_overhead_s'] * 1e6:.1f} us; "
        + ", ".join(f"{k} {v}" for k, v in proposed.items())
        + (f"; host {', '.join(f'{k} {v:.3g}' for k, v in host.items())}" if host else "")
        + f" ({calib['basis']})"
    )
    hw["sources"] = [s for s in hw.get("sources", []) if not s.startswith("calibrated on ")]
    hw["sources"].append(note)
    return hw
