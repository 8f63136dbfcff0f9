"""The command line of a generated package (what `torchrun -m <package> ...` accepts).

    args = parse_args(["--steps", "20", "--schedule", "gpipe"], plan)

Defaults come from the plan: its schedule, micro-batches, optimizer and learning rate.
"""

from __future__ import annotations

import argparse

import torch

from .data import SOURCES
from .optim import DECAYS, OPTIMIZERS


def parse_args(argv, plan: dict) -> argparse.Namespace:
    model = plan.get("model", {})
    p = argparse.ArgumentParser(prog="python -m <package>", description="Fine-tune the pipeline.")
    p.add_argument("--steps", type=int, default=10, help="optimizer steps in all (default 10)")
    p.add_argument(
        "--schedule",
        choices=("gpipe", "1f1b", "ftpipe"),
        default=None,
        help=f"override the plan's schedule ({plan.get('schedule')})",
    )
    p.add_argument(
        "--micro-batches",
        type=int,
        default=None,
        help=f"per optimizer step (plan: {plan.get('micro_batches')})",
    )
    p.add_argument("--lr", type=float, default=float(model.get("lr") or 1e-3))
    p.add_argument(
        "--optimizer",
        choices=sorted(OPTIMIZERS),
        default=str(plan.get("optimizer") or model.get("optimizer") or "adamw").lower(),
    )
    p.add_argument("--warmup", type=int, default=0, help="steps of linear learning-rate warm-up")
    p.add_argument("--decay", choices=sorted(DECAYS), default="linear")
    p.add_argument("--clip", type=float, default=1.0, help="max gradient norm; 0: no clipping")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--data",
        default=None,
        help=f"{' | '.join(SOURCES)} (default synthetic) or a .pt / .jsonl of token ids",
    )
    p.add_argument("--init", default=None, help="a .pt state dict to start from (by name)")
    p.add_argument("--save-every", type=int, default=0, help="checkpoint every N steps")
    p.add_argument("--checkpoint-dir", default="checkpoints")
    p.add_argument("--resume", action="store_true", help="continue from the newest checkpoint")
    p.add_argument(
        "--timeout",
        type=float,
        default=60.0,
        help="seconds to wait for a peer before giving up (default 60)",
    )
    p.add_argument(
        "--device", choices=("cpu", "cuda"), default="cuda" if torch.cuda.is_available() else "cpu"
    )
    p.add_argument("--init-method", default="env://", help="torch.distributed rendezvous")
    p.add_argument("--log-json", default=None, help="write losses and checksums here (rank 0)")
    p.add_argument("--log-every", type=int, default=1)
    args = p.parse_args(argv)
    if args.steps < 1 or (args.micro_batches is not None and args.micro_batches < 1):
        p.error("--steps and --micro-batches must be at least 1")
    return args
