"""Every schedule, several stages on one device (a world-size-1 run: one rank runs all the
stages in the schedule's order), against the same run on the CPU in fp32: losses and
weights within 1e-5 (TF32 off: --no-tf32). A schedule the runtime refuses for this plan on
the CPU too is listed with its reason. On a CPU the runs are made once (nothing to compare).
"""

from __future__ import annotations

import math

from ..packages import RunRefused, compiled
from ..registry import Check, Findings, part

RTOL = 1e-5


def difference(a: dict, b: dict) -> float:
    """The largest relative difference of two runs' losses and weights: each loss against
    itself, each parameter's sum and sum of squares against its norm and its square (a sum
    of weights can be near 0 where the weights are not)."""
    losses = zip(a["losses"][-len(b["losses"]) :], b["losses"][-len(a["losses"]) :])
    out = [abs(x - y) / max(abs(y), 1e-12) for x, y in losses]
    for k, (total, squares) in b["checksums"].items():
        norm = max(squares, 1e-24) ** 0.5
        out += [abs(a["checksums"][k][0] - total) / norm,
                abs(a["checksums"][k][1] - squares) / max(squares, 1e-24)]  # fmt: skip
    return max(out)


def small_package(check: Check, stages: int | None = None):
    """The small model's package with `stages` stages (default: the sizes' several)."""
    s = check.sizes
    k = stages or s.schedule_stages
    return compiled(check, f"schedules-{k}", [
        "-m", s.schedule_model, "-g", str(k), "-p", "acyclic", "--schedule", "1f1b",
        "--hardware", "cpu",
    ])  # fmt: skip


@part("schedules", "Every schedule, several stages on one device, against the CPU",
      cuda_s=90, cpu_s=90, needs=("compiler",))  # fmt: skip
def schedules(check: Check, found: Findings) -> None:
    from ftpipe_runtime import SCHEDULES

    s = check.sizes
    # Several stages on one GPU; the looped and V-shaped schedules (wpipe, interleaved, zbv)
    # take exactly two per GPU, so those that refuse the first plan run the second.
    packages = [small_package(check, k) for k in (s.schedule_stages, 2)]
    found["model"] = s.schedule_model
    found["stages"] = [len(p.plan["stages"]) for p in packages]
    found.expect(min(found["stages"]) >= 2, "a plan has one stage: nothing to pipeline")
    # SGD: an update linear in the gradient, so rounding stays rounding (AdamW's first steps
    # move every weight by about lr, whichever way a near-zero gradient's sign falls).
    common = ["--steps", str(s.schedule_steps), "--dtype", "fp32", "--no-tf32",
              "--optimizer", "sgd", "--lr", "0.05", "--decay", "constant"]  # fmt: skip
    rows = {}
    for name in SCHEDULES:
        work = check.work / "schedules" / name
        refused = []
        for pkg in packages:
            plan = pkg.one_rank()
            try:
                cpu = pkg.run(plan, [*common, "--schedule", name, "--device", "cpu"], work / "cpu")
                break
            except RunRefused as e:
                refused.append(str(e))
        else:
            rows[name] = {"status": "refused on the CPU too", "reason": " / ".join(refused)}
            continue
        row = {"stages": len(plan["stages"]), "losses_cpu": cpu["losses"]}
        finite = all(math.isfinite(x) for x in cpu["losses"])
        found.expect(finite, f"{name}: a loss on the CPU is not finite: {cpu['losses']}")
        if check.device == "cuda":
            gpu = pkg.run(plan, [*common, "--schedule", name, "--device", "cuda"], work / "gpu")
            row["losses_gpu"] = gpu["losses"]
            row["max_relative_difference"] = difference(gpu, cpu)
            found.expect(row["max_relative_difference"] <= RTOL,
                         f"{name}: GPU and CPU differ by {row['max_relative_difference']:.2g} "
                         f"(relative; at most {RTOL})")  # fmt: skip
        row["status"] = "compared" if check.device == "cuda" else "ran"
        rows[name] = row
        check.say(f"schedules: {name}: {row['status']}" + (
            f", {row['max_relative_difference']:.2g}" if "max_relative_difference" in row else ""))  # fmt: skip
    found["runs"] = rows
    found.expect(any(r["status"] != "refused on the CPU too" for r in rows.values()),
                 "every schedule was refused")  # fmt: skip
