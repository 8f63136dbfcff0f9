"""Compiled packages, in this process: compile once per set of options, import, run.

    pkg = compiled(check, "llama", ["-m", "llama-tiny", "-g", "2", ...])
    plan = pkg.one_rank()                              # every stage on GPU 0: world size 1
    summary = pkg.run(plan, ["--device", "cuda", "--steps", "3"], check.work / "run")

A run on one rank needs no torch.distributed: the runtime's `run`, called here, is the whole
pipeline (a rank runs all the stages the plan puts on it, in the schedule's order).
"""

from __future__ import annotations

import contextlib
import copy
import io
import json
from dataclasses import dataclass
from pathlib import Path

__all__ = ["Package", "RunRefused", "compiled", "hardware_for"]


class RunRefused(Exception):
    """The runtime refused the run (its one-sentence reason)."""


@dataclass
class Package:
    folder: Path  # the package's folder (its plan.json, stages.py)
    plan: dict
    stages: dict  # stage number -> class
    compile_s: float

    def one_rank(self) -> dict:
        """The plan with every stage on GPU 0 (world size 1)."""
        plan = copy.deepcopy(self.plan)
        plan["gpus"] = 1
        for s in plan["stages"]:
            s["gpu"] = 0
        plan["replicas"], plan["placement"], plan["cluster"] = 1, [], None
        return plan

    def run(self, plan: dict, argv: list[str], work: Path) -> dict:
        """The runtime's summary of a run of `plan` (checkpoints under `work`)."""
        import ftpipe_runtime

        work.mkdir(parents=True, exist_ok=True)
        argv = [*argv, "--log-every", "1000"]
        if "--checkpoint-dir" not in argv:
            argv += ["--checkpoint-dir", str(work / "checkpoints")]
        try:
            return ftpipe_runtime.run(plan, self.stages, argv)
        except SystemExit as e:  # the runtime's one sentence for a run it refuses
            raise RunRefused(str(e.code)) from None


def compiled(check, key: str, args: list[str]) -> Package:
    """The package `ftpipe compile <args>` makes (once per `key` in this check)."""
    import time

    if key in check.cache:
        return check.cache[key]
    from ftpipe_compiler.cli import cli

    out = check.work / "packages" / key
    check.say(f"compiling {key}: ftpipe compile {' '.join(args)}")
    start = time.monotonic()
    said = io.StringIO()
    try:
        with contextlib.redirect_stdout(said):
            cli.main(args=["compile", *args, "-o", str(out), "--force"], standalone_mode=False)
    except SystemExit as e:  # click's exit for a usage error or an FtpipeError
        if e.code:
            raise RuntimeError(f"ftpipe compile failed: {said.getvalue()[-1500:]}") from None
    except Exception as e:  # noqa: BLE001 - click raises its own errors without exiting
        raise RuntimeError(f"ftpipe compile failed ({e}): {said.getvalue()[-1500:]}") from None
    from ftpipe_runtime.stage.package import import_package

    folder = next(p for p in out.iterdir() if (p / "stages.py").is_file())
    module = import_package(folder, prefix="gpu_check")
    pkg = Package(folder, json.loads((folder / "plan.json").read_text()), module.STAGES,
                  time.monotonic() - start)  # fmt: skip
    check.cache[key] = pkg
    return pkg


# GPU name (as CUDA says it) -> the hardware file that describes it.
HARDWARE_NAMES = {"H100": "h100-80gb", "H200": "h200", "A100": "a100-80gb", "L40S": "l40s",
                  "L4": "l4", "A10G": "a10g"}  # fmt: skip


def hardware_for(device: str) -> str:
    """The hardware file to cost this device with (`cpu` on a CPU, `h100-80gb` otherwise)."""
    if device != "cuda":
        return "cpu"
    import torch

    name = torch.cuda.get_device_name()
    return next((f for k, f in HARDWARE_NAMES.items() if k in name), "h100-80gb")
