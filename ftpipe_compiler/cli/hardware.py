"""The hardware `--hardware` defaults to: the GPU in this machine when a hardware file
describes it, else a GPU a fine-tuner owns today (an RTX 4090, 24 GB).

    default_hardware()                                   # "rtx4090" here (no GPU)
    hardware_for("NVIDIA A100-SXM4-80GB", 85_100_000_000)  # "a100-80gb"
"""

from __future__ import annotations

import re

import torch

from ..resources import load_config

__all__ = ["DEFAULT", "default_hardware", "hardware_for"]

DEFAULT = "rtx4090"
# A word of torch.cuda.get_device_name() -> the hardware files of that GPU; the memory
# chooses among them, and a GPU of another size (a 16 GB V100) matches none.
GPUS = {
    "H200": ("h200",),
    "H100": ("h100-80gb",),
    "A100": ("a100-40gb", "a100-80gb"),
    "L40S": ("l40s",),
    "L4": ("l4",),
    "A10G": ("a10g",),
    "RTX 4090": ("rtx4090",),
    "RTX 3090": ("rtx3090",),
    "RTX 2080 Ti": ("rtx2080ti",),
    "V100": ("v100-32gb",),
    "RTX 5000": ("quadro-rtx5000",),
}
SIZE_SLACK = 0.15  # a device reports a little less (or more) memory than its box says


def hardware_for(device_name: str, memory_bytes: int) -> str | None:
    """The hardware file of a CUDA device, by its name and memory; None when none fits."""
    name = re.sub(r"[-_]", " ", device_name).upper()
    for word, files in GPUS.items():
        if not re.search(rf"\b{re.escape(word.upper())}\b", name):
            continue
        sizes = {f: load_config("hardware", f)["memory_bytes"] for f in files}
        best = min(files, key=lambda f: abs(sizes[f] - memory_bytes))
        if abs(sizes[best] - memory_bytes) <= SIZE_SLACK * sizes[best]:
            return best
    return None


def default_hardware() -> str:
    """This machine's first GPU's hardware file when there is one, else DEFAULT."""
    if not torch.cuda.is_available():
        return DEFAULT
    props = torch.cuda.get_device_properties(0)
    return hardware_for(props.name, props.total_memory) or DEFAULT
