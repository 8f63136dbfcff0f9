"""What ran the check: Python, torch, CUDA, cuDNN, NCCL, the GPU, TF32, the packages."""

from __future__ import annotations

import os
import platform
import subprocess
from importlib import metadata

from ..bootstrap import ROOT, missing
from ..registry import Check, Findings, part

PACKAGES = ("transformers", "safetensors", "tokenizers", "peft", "pymetis", "datasets")


def _version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def _commit() -> str | None:
    try:
        out = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
                             capture_output=True, text=True, timeout=10)  # fmt: skip
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() or None


@part("environment", "Environment", cuda_s=20, cpu_s=20)
def environment(check: Check, found: Findings) -> None:
    import torch
    from ftpipe_runtime.job.device import tf32_state, use_tf32

    found["python"] = platform.python_version()
    found["platform"] = platform.platform()
    found["cpu_cores"] = os.cpu_count()
    found["torch"] = torch.__version__
    found["ftpipe_commit"] = _commit()
    found["packages"] = {n: _version(n) for n in PACKAGES}
    found["missing"] = missing("pymetis", "datasets", "transformers")
    found["setup"] = check.notes
    if check.device != "cuda":
        found["device"] = "cpu"
        return
    found.expect(torch.cuda.is_available(), "torch sees no GPU")
    props = torch.cuda.get_device_properties(0)
    found["cuda"] = torch.version.cuda
    found["cudnn"] = torch.backends.cudnn.version()
    nccl = getattr(torch.cuda, "nccl", None)
    version = nccl.version() if nccl is not None else None
    found["nccl"] = ".".join(map(str, version)) if isinstance(version, tuple) else version
    found["gpu"] = {
        "name": props.name,
        "count": torch.cuda.device_count(),
        "capability": f"{props.major}.{props.minor}",
        "memory_bytes": props.total_memory,
        "multiprocessors": props.multi_processor_count,
    }
    found["tf32_by_default"] = tf32_state()  # torch's own, before the runtime sets it
    use_tf32(torch.device("cuda"), True)
    found["tf32_as_runs_set_it"] = tf32_state()
    found.expect(
        found["tf32_as_runs_set_it"]["matmul"] == "high",
        "the runtime's --tf32 did not set fp32 products to TF32",
    )
    found["tf32_supported"] = props.major >= 8
