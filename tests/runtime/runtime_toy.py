"""A hand-made four-stage pipeline following the generated-package contract, and its model.

Stages and transfers (ids are topological; stage 3 computes the loss):

    0: x0 = emb[input_ids]; h0 = tanh(l0(x0)); keep = attention_mask    -> h0, x0, keep, emb
    1: h1 = tanh(l1(h0 + x0))                                            -> h1
    2: h2 = tanh(l2(h1)) + h0                                            -> h2
    3: loss = CE((h2 + x0) @ emb.T + head.bias, labels) over keep == 1

h0 goes to stages 1 and 2, x0 to stages 1 and 3 (non-adjacent), `keep` is an integer
tensor (no gradient), and `emb.weight` is tied: stage 0 owns it and sends it to stage 3 with
every micro-batch (its gradient comes back). `ToyModel` is the same network written in one
piece: the single-process reference.
"""

from __future__ import annotations

import json
import math
import zlib
from pathlib import Path

import torch
import torch.nn.functional as F
from ftpipe_runtime.spec.plan import PLAN_FORMAT, PLAN_KIND
from torch import nn

V, D, L, B = 16, 8, 6, 2  # vocabulary, width, sequence, micro-batch
PARAMS = {
    "emb.weight": (V, D),
    "l0.weight": (D, D),
    "l0.bias": (D,),
    "l1.weight": (D, D),
    "l1.bias": (D,),
    "l2.weight": (D, D),
    "l2.bias": (D,),
    "head.bias": (V,),
}
STAGE_PARAMS = {
    0: ("emb.weight", "l0.weight", "l0.bias"),
    1: ("l1.weight", "l1.bias"),
    2: ("l2.weight", "l2.bias"),
    3: ("head.bias",),
}
LAYOUTS = {
    "two-ranks": {0: 0, 1: 1, 2: 0, 3: 1},
    "three-ranks": {0: 0, 1: 1, 2: 0, 3: 2},
    "folded": {0: 0, 1: 1, 2: 1, 3: 0},  # the weight's owner and reader share rank 0
    "four-ranks": {0: 0, 1: 1, 2: 2, 3: 3},
}


def init_value(name: str) -> torch.Tensor:
    gen = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    return torch.randn(PARAMS[name], generator=gen) * 0.5


class _Holder(nn.Module):
    """Registers parameters under dotted canonical names, like generated stages do, in the
    compute dtype the run asks for (`dtype`; None: fp32)."""

    def __init__(self, names, device="cpu", dtype=None):
        super().__init__()
        for name in names:
            owner: nn.Module = self
            *path, leaf = name.split(".")
            for part in path:
                if part not in owner._modules:
                    owner.add_module(part, nn.Module())
                owner = owner._modules[part]
            value = init_value(name).to(device, dtype or torch.float32)
            owner.register_parameter(leaf, nn.Parameter(value))


def _linear(module, x):
    return F.linear(x, module.weight, module.bias)


def _loss(h2, x0, keep, labels, emb_weight, head_bias):
    logits = (h2 + x0) @ emb_weight.t() + head_bias.bias
    per_token = F.cross_entropy(logits.reshape(-1, V), labels.reshape(-1), reduction="none")
    weights = keep.reshape(-1).float()
    return (per_token * weights).sum() / weights.sum()


class Stage0(_Holder):
    STAGE, INPUTS = 0, ("input_ids", "attention_mask")
    OUTPUTS = ("h0", "x0", "keep", "emb.weight")

    def __init__(self, device="cpu", dtype=None, materialize=True):
        super().__init__(STAGE_PARAMS[0], device, dtype)

    def forward(self, input_ids, attention_mask):
        x0 = self.emb.weight[input_ids]
        h0 = torch.tanh(_linear(self.l0, x0))
        return {"h0": h0, "x0": x0, "keep": attention_mask * 1, "emb.weight": self.emb.weight}


class Stage1(_Holder):
    STAGE, INPUTS, OUTPUTS = 1, ("h0", "x0"), ("h1",)

    def __init__(self, device="cpu", dtype=None, materialize=True):
        super().__init__(STAGE_PARAMS[1], device, dtype)

    def forward(self, h0, x0):
        return {"h1": torch.tanh(_linear(self.l1, h0 + x0))}


class Stage2(_Holder):
    STAGE, INPUTS, OUTPUTS = 2, ("h1", "h0"), ("h2",)

    def __init__(self, device="cpu", dtype=None, materialize=True):
        super().__init__(STAGE_PARAMS[2], device, dtype)

    def forward(self, h1, h0):
        return {"h2": torch.tanh(_linear(self.l2, h1)) + h0}


class Stage3(_Holder):
    STAGE, INPUTS, OUTPUTS = 3, ("h2", "x0", "keep", "labels", "emb.weight"), ("loss",)

    def __init__(self, device="cpu", dtype=None, materialize=True):
        super().__init__(STAGE_PARAMS[3], device, dtype)

    def forward(self, h2, x0, keep, labels, **received):
        return {"loss": _loss(h2, x0, keep, labels, received["emb.weight"], self.head)}


STAGES = {0: Stage0, 1: Stage1, 2: Stage2, 3: Stage3}


class DropStage1(Stage1):
    """Stage 1 with dropout: its masks must repeat at the recompute and after a resume."""

    def forward(self, h0, x0):
        return {"h1": F.dropout(torch.tanh(_linear(self.l1, h0 + x0)), 0.5, self.training)}


DROPOUT_STAGES = {**STAGES, 1: DropStage1}


class ToyModel(_Holder):
    """The unpartitioned network: forward(**inputs) -> loss."""

    def __init__(self):
        super().__init__(PARAMS)

    def forward(self, input_ids, attention_mask, labels):
        x0 = self.emb.weight[input_ids]
        h0 = torch.tanh(_linear(self.l0, x0))
        h1 = torch.tanh(_linear(self.l1, h0 + x0))
        h2 = torch.tanh(_linear(self.l2, h1)) + h0
        return _loss(h2, x0, attention_mask, labels, self.emb.weight, self.head)


def toy_plan(
    layout: str = "two-ranks", schedule: str = "gpipe", micro_batches: int = 4, dtype="float32"
) -> dict:
    """The toy's plan; `dtype`: the compute dtype it is "compiled" for (its weights and
    floating-point messages), which `--dtype` must match (bf16: bfloat16)."""
    gpu = LAYOUTS[layout]
    size = torch.empty((), dtype=getattr(torch, dtype)).element_size()
    act = [B, L, D]
    transfers = [
        ("h0", 0, (1, 2), act, dtype, True),
        ("x0", 0, (1, 3), act, dtype, True),
        ("keep", 0, (3,), [B, L], "int64", False),
        ("h1", 1, (2,), act, dtype, True),
        ("h2", 2, (3,), act, dtype, True),
        ("emb.weight", 0, (3,), [V, D], dtype, True),
    ]
    inputs = {0: ["h0", "x0", "keep", "emb.weight"], 1: ["h1"], 2: ["h2"], 3: ["loss"]}
    received = {s: [t[0] for t in transfers if s in t[2]] for s in range(4)}
    model_inputs = {0: ["input_ids", "attention_mask"], 1: [], 2: [], 3: ["labels"]}
    depth = {0: 3, 1: 2, 2: 1, 3: 0}
    # Every field a plan has (the runtime reads plans through the compiler's one reader):
    # the cost figures the toy runs without are 0.
    return {
        "format": PLAN_FORMAT,
        "kind": PLAN_KIND,
        "partitioner": "toy",
        "bandwidth": 1e9,
        "memory_bytes": 2**34,
        "gpus": len(set(gpu.values())),
        "schedule": schedule,
        "micro_batches": micro_batches,
        "optimizer": "adamw",
        "loss_stage": 3,
        "stages": [
            {
                "id": s,
                "gpu": gpu[s],
                "nodes": [f"s{s}"],
                "fwd_s": 0.0,
                "bwd_s": 0.0,
                "recompute_s": 0.0,
                "input_bytes": 0,
                "act_bytes": 0,
                "depth": depth[s],
                "inputs": received[s],
                "outputs": [o for o in inputs[s] if o != "loss"],
                "model_inputs": model_inputs[s],
                "params": list(STAGE_PARAMS[s]),
                "recompute": s != 3,
            }
            for s in range(4)
        ],
        "transfers": [
            {
                "tensor": n,
                "producer": p,
                "consumers": list(c),
                "shape": shape,
                "dtype": dt,
                "bytes": size * (V * D if n == "emb.weight" else B * L * D),
                "requires_grad": rg,
            }
            for n, p, c, shape, dt, rg in transfers
        ],
        "params": [
            {
                "name": n,
                "shape": list(shape),
                "dtype": dtype,
                "bytes": size * math.prod(shape),
                "static_bytes": 4 * size * math.prod(shape),
                "trainable": True,
                "aliases": [],
                "stages": [s for s in range(4) if n in STAGE_PARAMS[s]],  # its one owner
            }
            for n, shape in PARAMS.items()
        ],
        "model": {
            "head": "causal-lm",  # labels are the input ids: `--data copy` is learnable
            "micro_batch": B,
            "batch": B * micro_batches,
            "lr": 0.01,
            "optimizer": "adamw",
            "vocab": {"vocab_size": V},
            "task": "toy",
            "compute_dtype": dtype,
            "inputs": {
                "input_ids": [[B, L], "int64"],
                "attention_mask": [[B, L], "int64"],
                "labels": [[B, L], "int64"],
            },
        },
    }


def write_ragged(path, samples: int = 24) -> str:
    """A .jsonl of toy samples of 2 to L tokens: micro-batches of different numbers of label
    tokens (padding labelled -100), where a mean of per-micro-batch means and the step's
    token mean differ."""
    gen = torch.Generator().manual_seed(1)
    lines = []
    for i in range(samples):
        n = 2 + (i * 7 + i // 3) % (L - 1)
        lines.append(json.dumps(torch.randint(0, V, (n,), generator=gen).tolist()))
    Path(path).write_text("\n".join(lines) + "\n")
    return str(path)


def one_rank_plan(schedule: str = "gpipe", micro_batches: int = 4, dtype="float32") -> dict:
    """The toy's four stages all on one rank: `run` needs no torch.distributed then."""
    plan = toy_plan("two-ranks", schedule, micro_batches, dtype)
    plan["gpus"] = 1
    for s in plan["stages"]:
        s["gpu"] = 0
    return plan


if __name__ == "__main__":  # one rank of a toy pipeline: runtime_toy.py PLAN.json [runtime args]
    import os
    import sys

    import ftpipe_runtime

    stages = DROPOUT_STAGES if os.environ.get("FTPIPE_TOY_DROPOUT") else STAGES
    with open(sys.argv[1]) as f:
        ftpipe_runtime.run(json.load(f), stages, sys.argv[2:])
