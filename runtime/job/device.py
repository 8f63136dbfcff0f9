"""The device a rank computes on, and how it computes there: which GPU, how many CPU threads,
and whether fp32 matrix products run on TF32 tensor cores.

    device = pick_device("cuda", local_rank=3)   # cuda:3, or cuda:0 when it is the only one
    cap_threads(local_world=8)                    # the node's cores shared by its ranks
    use_tf32(device, on=True)                     # fp32 products in TF32 (Ampere and later)

TF32 (`--tf32`, the default): on an Ampere or later GPU an fp32 matrix product then rounds
its inputs to a 10-bit mantissa and runs on the tensor cores, about 8x the plain fp32 rate
on an A100 or H100 (the hardware files' `peak_flops_tf32` against `peak_flops`); sums stay
fp32. The compiler's fp32 costs assume it (`ftpipe_compiler.costs.hardware`), as PyTorch's own
default (products in full fp32) would be 8x slower than planned. `--no-tf32` runs them in
full fp32: for runs compared element by element with a CPU run, say. CPUs are left alone.
"""

from __future__ import annotations

import os

import torch

__all__ = ["cap_threads", "pick_device", "tf32_state", "use_tf32"]


def pick_device(kind: str, local_rank: int) -> torch.device:
    """This rank's device: the CPU, or its node's GPU number `local_rank` among those it sees.
    A launcher that gives each process its own CUDA_VISIBLE_DEVICES (one GPU visible) makes
    that GPU cuda:0 in every process; in general, local rank modulo the visible count."""
    if kind != "cuda":
        return torch.device("cpu")
    return torch.device("cuda", local_rank % max(1, torch.cuda.device_count()))


def cap_threads(local_world: int) -> None:
    """The node's cores shared by its ranks (unless OMP_NUM_THREADS says otherwise): a GPU
    rank's CPU threads too, which otherwise each take every core for the host's share of
    the work (data, the optimizer step of a CPU-held tensor) and crowd each other out."""
    if "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(1, local_world)))


def use_tf32(device: torch.device, on: bool) -> None:
    """fp32 matrix products and cuDNN convolutions on TF32 tensor cores, or in full fp32, on a
    GPU; a no-op on a CPU. Through `set_float32_matmul_precision` (torch 1.12 on) and cuDNN's
    `allow_tf32`, which set what the newer per-backend `fp32_precision` flags read."""
    if torch.device(device).type != "cuda":
        return
    torch.set_float32_matmul_precision("high" if on else "highest")
    torch.backends.cudnn.allow_tf32 = on


def tf32_state() -> dict:
    """What fp32 products run as now: {"matmul": "high" | "highest" | "medium", "cudnn": bool}."""
    return {
        "matmul": torch.get_float32_matmul_precision(),
        "cudnn": bool(torch.backends.cudnn.allow_tf32),
    }
