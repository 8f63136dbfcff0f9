"""The command line of a generated package (what `torchrun -m <package> ...` accepts).

    args = parse_args(["--steps", "20", "--schedule", "gpipe"], plan)

Defaults come from the plan: its schedule, micro-batches, optimizer and learning rate.
Every number is checked here (a usage error, exit code 2): `--lr nan`, `--timeout 0` or
`--save-every -1` never reach training.
"""

from __future__ import annotations

import argparse
import math

import torch

from .comm import POST_AHEAD_BYTES
from .data import SOURCES
from .export import MERGE_HELP
from .freezing import parse_freeze_at
from .optim import DECAYS, OPTIMIZERS
from .precision import PRECISIONS
from .schedules import SCHEDULES
from .text_data import TEXT_FORMATS


def _schedule(text: str) -> str:
    """A schedule's name, or a .csv file of per-GPU actions (read and checked by `run`)."""
    if text in SCHEDULES or text.lower().endswith(".csv"):
        return text
    raise argparse.ArgumentTypeError(
        f"unknown schedule {text!r}; choose from {', '.join(SCHEDULES)} or give a .csv file"
    )


def number(kind, low, above: bool = False):
    """An argparse type: an int or a finite float, at least `low` (greater with `above`)."""

    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"{text!r} is not {'an integer' if kind is int else 'a number'}"
            ) from None
        if kind is float and not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"{text} is not a finite number")
        if value < low or (above and value == low):
            raise argparse.ArgumentTypeError(
                f"{text} must be {'above' if above else 'at least'} {low}"
            )
        return value

    return parse


def parse_args(argv, plan: dict) -> argparse.Namespace:
    model = plan.get("model", {})
    p = argparse.ArgumentParser(prog="python -m <package>", description="Fine-tune the pipeline.")
    length = p.add_mutually_exclusive_group()
    length.add_argument(
        "--steps",
        type=number(int, 1),
        default=None,
        help="optimizer steps in all (default 10, or what --epochs makes)",
    )
    length.add_argument(
        "--epochs",
        type=number(float, 0, above=True),
        default=None,
        help="passes over --data instead of --steps (rounded up to whole steps)",
    )
    p.add_argument(
        "--schedule",
        type=_schedule,
        default=None,
        help=f"override the plan's schedule ({plan.get('schedule')}): {', '.join(SCHEDULES)}, "
        "or a .csv file of per-GPU actions",
    )
    p.add_argument(
        "--micro-batches",
        type=number(int, 1),
        default=None,
        help=f"per optimizer step (plan: {plan.get('micro_batches')})",
    )
    p.add_argument("--lr", type=number(float, 0), default=float(model.get("lr") or 1e-3))
    p.add_argument(
        "--dtype",
        choices=list(PRECISIONS),
        default=model.get("precision") or "fp32",
        help=f"training precision (compiled: {model.get('precision') or 'fp32'}); "
        "fp32 runs any package",
    )
    p.add_argument(
        "--optimizer",
        choices=sorted(OPTIMIZERS),
        default=str(plan.get("optimizer") or model.get("optimizer") or "adamw").lower(),
    )
    p.add_argument(
        "--warmup", type=number(int, 0), default=0, help="steps of linear learning-rate warm-up"
    )
    p.add_argument("--decay", choices=sorted(DECAYS), default="linear")
    p.add_argument(
        "--clip", type=number(float, 0), default=1.0, help="max gradient norm; 0: no clipping"
    )
    p.add_argument("--seed", type=int, default=0)
    data = p.add_argument_group("data (README: fine-tuning)")
    data.add_argument(
        "--data",
        default=None,
        help=f"{' | '.join(SOURCES)} (default synthetic), a .pt / .jsonl of token ids, or text: "
        f"{' / '.join(TEXT_FORMATS)}",
    )
    data.add_argument("--eval-data", default=None, help="a file like --data, evaluated in order")
    data.add_argument(
        "--eval-every",
        type=number(int, 0),
        default=0,
        help="evaluate every N steps (0: at the end)",
    )
    data.add_argument("--text-field", default=None, help="the field of the text (default text)")
    data.add_argument("--prompt-field", default=None, help="with --target-field: loss on targets")
    data.add_argument("--target-field", default=None)
    data.add_argument(
        "--tokenizer", default=None, help="tokenizer folder (default: the compiled model's)"
    )
    data.add_argument("--pack", action="store_true", help="causal LM: join texts into full rows")
    data.add_argument(
        "--truncate",
        action="store_true",
        help="cut texts longer than the compiled length (default: refuse them)",
    )
    data.add_argument(
        "--shuffle-seed", type=int, default=None, help="order of the samples (default --seed)"
    )
    p.add_argument("--init", default=None, help="a .pt state dict to start from (by name)")
    p.add_argument(
        "--save-every", type=number(int, 0), default=0, help="checkpoint every N steps (0: never)"
    )
    p.add_argument(
        "--checkpoint-dir",
        default=None,
        help="where checkpoints go (default checkpoints/<model>-<plan hash>: one per plan)",
    )
    p.add_argument(
        "--keep-checkpoints",
        type=number(int, 0),
        default=3,
        help="complete checkpoints kept, the newest (default 3; 0: all)",
    )
    p.add_argument("--resume", action="store_true", help="continue from the newest checkpoint")
    p.add_argument(
        "--timeout",
        type=number(float, 0, above=True),
        default=60.0,
        help="seconds to wait for a peer before giving up (default 60)",
    )
    p.add_argument(
        "--post-ahead",
        type=number(float, 0),
        default=POST_AHEAD_BYTES / 2**20,
        help="MB of receive buffers posted ahead of need per peer, at most 64 messages "
        "(default %(default)g; 0: on demand)",
    )
    p.add_argument(
        "--device", choices=("cpu", "cuda"), default="cuda" if torch.cuda.is_available() else "cpu"
    )
    p.add_argument("--init-method", default="env://", help="torch.distributed rendezvous")
    p.add_argument("--log-json", default=None, help="write losses and checksums here (rank 0)")
    p.add_argument(
        "--trace",
        default=None,
        help="write every rank's action start and end times here (rank 0; JSON for "
        "`ftpipe simulate plan.json --compare`)",
    )
    p.add_argument(
        "--log-dir", default=None, help="log.jsonl and TensorBoard scalars (where installed)"
    )
    p.add_argument(
        "--save-hf",
        default=None,
        help="write the trained model here as a HuggingFace folder (LoRA: peft's adapter folder)",
    )
    p.add_argument("--merge-lora", action="store_true", help=MERGE_HELP)
    p.add_argument(
        "--save-hf-every-checkpoint",
        action="store_true",
        help="also write each complete checkpoint as <save-hf>/step-N",
    )
    p.add_argument("--log-every", type=number(int, 1), default=1)
    freeze = p.add_argument_group("freeze training (PipeTransformer §3.1; ftpipe_runtime.freezing)")
    freeze.add_argument(
        "--freeze-alpha",
        type=number(float, 0, above=True),
        default=None,
        help="freeze bottom layers by the gradient-norm rule with this alpha (0 < alpha < 1)",
    )
    freeze.add_argument(
        "--freeze-every",
        type=number(int, 1),
        default=100,
        help="optimizer steps between freeze decisions (default %(default)s)",
    )
    freeze.add_argument(
        "--freeze-at",
        type=_freeze_at,
        action="append",
        default=[],
        metavar="STEP:LAYERS",
        help="after STEP optimizer steps, LAYERS bottom layers are frozen (repeatable)",
    )
    freeze.add_argument(
        "--no-shrink",
        action="store_true",
        help="freeze, but keep training on this plan (leave the shorter ones in elastic/ unused)",
    )
    args = p.parse_args(argv)
    if args.freeze_alpha is not None and args.freeze_alpha >= 1:
        p.error(f"argument --freeze-alpha: {args.freeze_alpha} must be below 1")
    return args


def _freeze_at(text: str) -> tuple[int, int]:
    try:
        return parse_freeze_at(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
