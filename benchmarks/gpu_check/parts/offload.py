"""The Llama part's package (2 stages on one GPU, bf16, 1F1B) run again with each memory tool
of issue 35 (host offload): its optimizer state on the host with the gradients streamed
there each micro-batch (`--offload-optimizer`), the same with the gradients summed on the GPU
and sent once a step (the plan's `offload.gradients: device`), and its saved activations
parked on the host (`--offload-activations`), and the GPU sums' case again under FTPipe with
`--offload-step lagged` (each CPU step landing at the stage's next S, its losses only required
finite: a rule of its own). For each: the step time against the simulator's
for that plan (its host model: link, CPU step), the peak memory the GPU allocated against the
plan's, and the losses against the plain run's (the CPU's AdamW steps the masters, not the
GPU's fused one: equal within bf16 rounding, not bit for bit)."""

from __future__ import annotations

import copy
import math

from ..calibration import host_rates
from ..registry import Check, Findings, Skip, part
from ..timing import peak_bytes, reset_peak
from .llama import llama_package

LOSS_TOLERANCE = 0.05  # absolute, on losses near 12 after a few steps (bf16, two AdamWs)


def _offloaded(plan: dict, gradients: str | None, activations: bool, step: str = "exact") -> dict:
    """The plan with every stage's optimizer state (`gradients`: where they sum; None: not
    offloaded; `step`: where its CPU step lands) or activations on the host."""
    plan = copy.deepcopy(plan)
    for s in plan["stages"]:
        s["offload"] = {"optimizer": gradients is not None, "activations": activations,
                        "gradients": gradients or "host", "step": step}  # fmt: skip
    return plan


def _simulated(plan: dict, host: dict | None = None, schedule: str = "1f1b"):
    """The simulator's run of `plan`; `host`: the rates part's measured host rates in place of
    the hardware file's (the step and sums the better of one thread and all cores)."""
    from dataclasses import replace

    from ftpipe_compiler.plan import Plan
    from ftpipe_compiler.simulate import simulate

    p = Plan.from_dict(plan)
    if host:
        p = p.with_(host=replace(p.host, **host))
    return simulate(p, schedule, int(plan["micro_batches"]), steps=10)


def _phases(plan: dict, summary: dict, steps: int) -> dict | None:
    """Per step on the run's rank: the seconds each part of the offloaded step took
    (`ftpipe_runtime.train.offload.PHASES`, grouped as the model groups them) beside the
    simulator's host model for the same plan (`costs.host.optimizer_times`), to show which
    part of the model misses."""
    from ftpipe_compiler.costs.host import optimizer_times
    from ftpipe_compiler.plan import Plan

    seconds = (summary.get("offload_seconds") or [None])[0]
    if not seconds:
        return None
    p = Plan.from_dict(plan)
    share = p.host.share(1)  # the one GPU of its node that offloads
    m = int(plan["micro_batches"])
    model = dict.fromkeys(("gradients_streamed", "sum_copies", "cpu_step", "upload"), 0.0)
    for stage in p.stages:
        if stage.offload.optimizer:
            t = optimizer_times(p, stage, share)
            model["gradients_streamed"] += m * t.grad_s
            model["sum_copies"] += t.sum_s
            model["cpu_step"] += t.cpu_s
            model["upload"] += t.upload_s
    got = {k: v / max(steps, 1) for k, v in seconds.items()}
    measured = {
        "gradients_streamed": got["to_host"] + got["copy_wait"] + got["host_sums"],
        "backward_wait": got["backward_wait"],  # the GPU's queued backwards, not the model's
        "sum_copies": got["sum_copies"],
        "cpu_step": got["cpu_step"],  # on the rank's step thread, beside its next actions
        "cpu_step_waited": got.get("step_wait", 0.0),  # of it, what the rank waited for
        "upload": got["to_device"] + got["upload_wait"],
    }
    return {"measured_per_step_s": measured, "modelled_per_step_s": model, "raw_per_step_s": got}


CASES = {  # name -> (where the gradients sum, None: no optimizer offload; activations;
    # where the CPU step lands, and under which schedule)
    "optimizer_streamed": ("host", False, "exact", "1f1b"),
    "optimizer_gpu_sums": ("device", False, "exact", "1f1b"),
    "activations": (None, True, "exact", "1f1b"),
    # the CPU step beside the next step's actions, landing at the stage's next S (its own
    # rule, one step more stale: its losses are recorded, only required finite)
    "optimizer_lagged": ("device", False, "lagged", "ftpipe"),
}


@part("offload", "Host offload: optimizer (streamed, GPU sums, lagged) and activations", cuda_s=300,
      cpu_s=60, needs=("compiler", "transformers"))  # fmt: skip
def offload(check: Check, found: Findings) -> None:
    s, dev = check.sizes, check.device
    base = check.results.get("llama") or {}
    if "losses" not in base or "measured_step_s" not in base:
        raise Skip("the llama part did not finish: nothing to compare with")
    pkg = llama_package(check)
    plain = pkg.one_rank()
    m = int(plain["micro_batches"])
    samples = m * s.llama_micro_batch
    argv = ["--device", dev, "--dtype", s.llama_dtype, "--decay", "constant", "--schedule",
            "1f1b", "--steps", str(s.llama_steps)]  # fmt: skip
    found["plain"] = {"step_s": base["measured_step_s"], "losses": base["losses"],
                      "peak_allocated": (base.get("measured_peak_bytes") or {}).get("allocated")}  # fmt: skip
    measured_host = host_rates(check.results.get("rates") or {}) or None
    found["measured_host"] = measured_host
    for name, (gradients, activations, step, schedule) in CASES.items():
        if check.left() < 60:
            found.expect(False, f"{name}: not run, the check's time ran out")
            break
        plan = _offloaded(plain, gradients, activations, step)
        sim = _simulated(plan, schedule=schedule)
        reset_peak(dev)
        summary = pkg.run(plan, [*argv, "--schedule", schedule], check.work / f"offload-{name}")
        step = samples / summary["steady_samples_per_s"]
        row = {"step_s": step, "simulated_step_s": sim.step_time_s,
               "measured_to_simulated": step / sim.step_time_s,
               "planned_peak_bytes": sim.gpus[0].peak_memory_bytes,
               "host_bytes_down": sim.gpus[0].host_bytes_down,
               "losses": summary["losses"], "slowdown": step / base["measured_step_s"]}  # fmt: skip
        phases = _phases(plan, summary, s.llama_steps)
        if phases:  # where the offloaded step's time went, against the model's parts
            row["phases"] = phases
        if measured_host:  # the same plan costed with the host this check measured
            on_host = _simulated(plan, measured_host, schedule).step_time_s
            row["simulated_step_s_measured_host"] = on_host
            row["measured_to_simulated_measured_host"] = step / on_host
        peak = peak_bytes(dev)
        if peak:
            row["peak_allocated"] = peak["allocated"]
            row["allocated_to_planned"] = peak["allocated"] / row["planned_peak_bytes"]
            if found["plain"]["peak_allocated"]:
                row["allocated_to_plain"] = peak["allocated"] / found["plain"]["peak_allocated"]
        found[name] = row
        worst = max(abs(a - b) for a, b in zip(summary["losses"], base["losses"]))
        if step == "lagged":
            worst = 0.0 if all(math.isfinite(x) for x in summary["losses"]) else math.inf
        found.expect(len(summary["losses"]) == len(base["losses"]) and worst <= LOSS_TOLERANCE,
                     f"{name}: losses {summary['losses']} against {base['losses']} "
                     f"(differ by {worst:.3g})")  # fmt: skip
