"""Checkpoint and resume on the device, bit for bit: 4 steps straight against 2 steps, a
checkpoint, and 2 more resumed from it; then `--save-hf` from the device, read back by
transformers and compared with the run's weights."""

from __future__ import annotations

import shutil

from ..registry import Check, Findings, part
from .schedules import difference, small_package


@part("resume", "Checkpoint, resume bit-exact, --save-hf", cuda_s=45, cpu_s=45,
      needs=("compiler", "transformers", "safetensors"))  # fmt: skip
def resume(check: Check, found: Findings) -> None:
    import torch

    pkg = small_package(check)
    plan, dev, work = pkg.one_rank(), check.device, check.work / "resume"
    shutil.rmtree(work, ignore_errors=True)
    argv = ["--device", dev, "--dtype", "fp32", "--no-tf32", "--decay", "constant",
            "--schedule", "1f1b"]  # fmt: skip
    straight = pkg.run(plan, [*argv, "--steps", "4"], work / "straight")
    again = pkg.run(plan, [*argv, "--steps", "4"], work / "again")
    ckpt = ["--save-every", "2", "--checkpoint-dir", str(work / "checkpoints")]
    pkg.run(plan, [*argv, "--steps", "2", *ckpt], work / "first")
    resumed = pkg.run(plan, [*argv, "--steps", "4", *ckpt, "--resume"], work / "resumed")
    found["losses_straight"] = straight["losses"]
    found["losses_resumed"] = resumed["losses"]
    found["first_step_resumed"] = resumed["first_step"]
    found.expect(resumed["first_step"] == 2, f"resumed at step {resumed['first_step']}, not 2")
    # A resumed run can be bit-exact only where two straight runs are (some CUDA kernels sum
    # with atomics): else it must be as close to the straight run as they are to each other.
    noise = difference(again, straight)
    found["straight_runs_differ_by"] = noise
    found["resumed_differs_by"] = off = difference(resumed, straight)
    if noise == 0:
        found.expect(resumed["losses"] == straight["losses"][2:],
                     f"resumed losses {resumed['losses']} != {straight['losses'][2:]}")  # fmt: skip
        found.expect(resumed["checksums"] == straight["checksums"],
                     f"the resumed weights differ from the straight run's by {off:.2g}")  # fmt: skip
    else:
        found.expect(off <= 10 * noise, f"resumed differs by {off:.2g}; two straight runs on "
                     f"this device by {noise:.2g}")  # fmt: skip

    folder = work / "hf"
    summary = pkg.run(plan, [*argv, "--steps", "2", "--save-hf", str(folder)], work / "export")
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
    worst = 0.0
    for name, p in model.named_parameters():
        want = summary["checksums"].get(name)
        if want is None:
            continue
        got = [float(p.detach().double().sum()), float(p.detach().double().pow(2).sum())]
        worst = max(worst, *(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(got, want)))
    found["save_hf_files"] = sorted(p.name for p in folder.iterdir())
    found["save_hf_max_relative_difference"] = worst
    found.expect(worst <= 1e-6, f"the exported weights differ from the run's by {worst:.2g}")
