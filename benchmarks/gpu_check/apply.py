"""Write a GPU check's proposed calibration into a hardware file (a step of its own, on
purpose: read GPU_CHECK.md first).

    python -m benchmarks.gpu_check.apply GPU_CHECK.json --write h100-80gb
    python -m benchmarks.gpu_check.apply GPU_CHECK.json            # print it, write nothing
    python -m benchmarks.gpu_check.apply GPU_CHECK.json --verify h100-80gb

--verify compiles the check's Llama-shaped package again (analytic costs: no GPU needed)
for that hardware file as it is now, simulates it on one GPU as the check ran it, and prints
the simulated step beside the measured one (the calibration's aim: within 15%).
"""

from __future__ import annotations

import argparse
import json
import sys

from .bootstrap import ROOT
from .calibration import applied


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("report", help="GPU_CHECK.json")
    ap.add_argument("--write", metavar="HARDWARE", help="the hardware file to write it into")
    ap.add_argument("--verify", metavar="HARDWARE", help="simulate the Llama run on this file")
    args = ap.parse_args(argv)
    try:
        report = json.loads(open(args.report, encoding="utf-8").read())
    except (OSError, ValueError) as e:
        print(f"cannot read the report {args.report}: {e}", file=sys.stderr)
        return 1
    if args.verify:
        return verify(report, args.verify)
    calib = report.get("calibration")
    if not calib:
        print(f"{args.report} proposes no calibration (no GPU measured); nothing to write",
              file=sys.stderr)  # fmt: skip
        return 1
    if not args.write:
        print(json.dumps(calib, indent=1))
        return 0
    path = ROOT / "configs" / "hardware" / f"{args.write}.json"
    if not path.is_file():
        print(f"no hardware file {path}; name one of configs/hardware/*.json", file=sys.stderr)
        return 1
    from ftpipe_runtime.atomic import write_atomic

    hw = applied(json.loads(path.read_text()), calib)
    write_atomic(path, json.dumps(hw, indent=2) + "\n")
    print(f"wrote {path}: {', '.join(f'{k} {v}' for k, v in calib['proposed'].items())}")
    return 0


def verify(report: dict, hardware: str) -> int:
    """Print the simulated step of the check's Llama run on `hardware` beside the measured."""
    import tempfile
    import time
    from pathlib import Path

    from .packages import compiled
    from .parts.llama import simulated_one_gpu
    from .registry import Check
    from .sizes import SIZES

    llama = next((p["figures"] for p in report.get("parts", []) if p["name"] == "llama"), {})
    if not llama.get("measured_step_s") or not llama.get("compile_args"):
        print("the report has no measured Llama step to verify against", file=sys.stderr)
        return 1
    args = list(llama["compile_args"])
    args[args.index("--hardware") + 1] = hardware
    work = Path(tempfile.mkdtemp(prefix="gpu-check-verify-"))
    check = Check("cpu", SIZES["cpu"], work, time.monotonic() + 3600)
    sim = simulated_one_gpu(compiled(check, "verify", args).one_rank())
    ratio = sim.step_time_s / llama["measured_step_s"]
    print(f"{hardware}: simulated {sim.step_time_s:.4g} s per step, measured "
          f"{llama['measured_step_s']:.4g} s: {ratio:.3f}x ({'within' if abs(ratio - 1) <= 0.15 else 'outside'} 15%)")  # fmt: skip
    return 0 if abs(ratio - 1) <= 0.15 else 1


if __name__ == "__main__":
    sys.exit(main())
