"""Optimizer offload (`--offload-optimizer`): a stage's master weights and optimizer state in
host memory, its optimizer step on the CPU.

    host = HostOffload(device)                       # this rank's device
    mixed = MixedPrecision(precision, modules, offload=host)
    # masters: host copies of the trainable weights (pinned on CUDA), what the optimizer steps
    host.arrive(stage, master, g)   # a gradient made on the device: to the host, summed there
    host.settle(stage)              # at the stage's S: every copy landed, its .grad complete
    host.upload(stage, pairs)       # after the CPU step: the new weights back to the device

Every trainable weight gets a master on the host, a copy distinct from the weight even in fp32
(fp32 under mixed precision, else the weight's dtype), so the optimizer's state, which it
makes like its parameters, is on the host too and the device keeps only the weights it
computes with. Each gradient goes to the host as the backward produces it (the weight's own
`.grad` freed at once), into a host buffer in the gradient's dtype (a 16-bit gradient crosses
the link in 16 bits), and is summed into the master's fp32 `.grad` on the host: the same
additions, in the same order, as the device sums them without offload, so the step is the same.

On CUDA the copy is asynchronous (pinned buffer, `non_blocking`): the sum on the host waits
for it only when the same weight's next gradient needs the buffer, or at the stage's step
(`settle`). The weights go back the same way after the step; the next step of the stage
waits for that copy before it changes the masters again. On the CPU the copies are plain
copies into distinct host tensors: the same code path, nothing to wait for.

Host memory per trainable element: the master (4 bytes under mixed precision), the optimizer's
state (AdamW: 8), the summed gradient (4) and the landing buffer (the gradient's dtype: 2 in
bf16); the device keeps the weight and, briefly, each gradient until its copy is issued.
"""

from __future__ import annotations

import torch

from .precision import add_grad

__all__ = ["HostOffload"]


class HostOffload:
    """The host side of this rank's stages' masters (see the module doc)."""

    def __init__(self, device):
        self.device = torch.device(device)
        self.pinned = self.device.type == "cuda"
        self._buffers: dict[int, torch.Tensor] = {}  # id(master) -> its gradient's landing
        self._pending: dict[int, dict[int, tuple]] = {}  # stage -> id(master) -> copy in flight
        self._uploads: dict[int, torch.cuda.Event] = {}  # stage -> its weights' copy back

    def master_of(self, weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """A host copy of `weight` in `dtype` (pinned on CUDA), what the optimizer steps."""
        host = torch.empty(weight.shape, dtype=dtype, device="cpu", pin_memory=self.pinned)
        host.copy_(weight.detach())
        return host.requires_grad_(True)

    def arrive(self, stage: int, master: torch.Tensor, g: torch.Tensor) -> None:
        """A gradient `g` (on the device) of the weight whose master is `master`."""
        key = id(master)
        pending = self._pending.setdefault(stage, {})
        if key in pending:  # its buffer is about to be reused: sum what it holds first
            self._land(*pending.pop(key))
        buf = self._buffers.get(key)
        if buf is None or buf.dtype != g.dtype:
            buf = torch.empty(g.shape, dtype=g.dtype, device="cpu", pin_memory=self.pinned)
            self._buffers[key] = buf
        if not self.pinned:
            buf.copy_(g)
            add_grad(master, buf)
            return
        buf.copy_(g, non_blocking=True)
        done = torch.cuda.Event()
        done.record()
        pending[key] = (master, buf, done)

    def settle(self, stage: int) -> None:
        """Before the stage's step: its gradients summed on the host, and its last weights'
        copy back to the device done (the step changes the masters it reads)."""
        for master, buf, done in self._pending.pop(stage, {}).values():
            self._land(master, buf, done)
        upload = self._uploads.pop(stage, None)
        if upload is not None:
            upload.synchronize()

    @torch.no_grad()
    def upload(self, stage: int, pairs) -> None:
        """(weight, master) pairs: the stepped masters into the device's weights."""
        for weight, master in pairs:
            weight.copy_(master, non_blocking=self.pinned)
        if self.pinned:
            done = torch.cuda.Event()
            done.record()
            self._uploads[stage] = done

    @staticmethod
    def _land(master: torch.Tensor, buf: torch.Tensor, done) -> None:
        done.synchronize()
        add_grad(master, buf)
