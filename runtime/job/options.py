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

from ..checkpoint.hf import MERGE_HELP
from ..data.batches import SOURCES
from ..data.text import TEXT_FORMATS
from ..engine.comm import POST_AHEAD_BYTES
from ..errors import ScheduleError
from ..freeze.layers import parse_freeze_at
from ..schedules import SCHEDULES, get_schedule
from ..train.optim import DECAYS, OPTIMIZERS
from ..train.precision import PRECISIONS


def _schedule(text: str) -> str:
    """A schedule's name, or a .csv file of per-GPU actions (read and checked by `run`)."""
    if text.lower().endswith(".csv"):
        return text
    try:
        get_schedule(text)
    except ScheduleError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def number(kind, low, above: bool = False, below=None):
    """An argparse type: an int or a finite float, at least `low` (greater with `above`) and
    less than `below` when given."""

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
        if below is not None and value >= below:
            raise argparse.ArgumentTypeError(f"{text} must be below {below}")
        return value

    return parse


def _fraction(text: str) -> float:
    """An argparse type: a number from 0 to 1."""
    value = number(float, 0)(text)
    if value > 1:
        raise argparse.ArgumentTypeError(f"{text} must be at most 1")
    return value


def parse_args(argv, plan: dict) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m <package>", description="Fine-tune the pipeline.")
    for group in (_training, _data, _checkpoints, _running, _outputs, _freezing):
        group(p, plan)
    return p.parse_args(argv)


def _training(p, plan: dict) -> None:
    """How long, on which schedule, with which update rule."""
    model = plan.get("model", {})
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
        help=f"override the plan's schedule ({plan.get('schedule')}): "
        f"{', '.join(SCHEDULES)}, or a .csv file of per-GPU actions",
    )
    p.add_argument(
        "--micro-batches",
        type=number(int, 1),
        default=None,
        help=f"per optimizer step (plan: {plan.get('micro_batches')})",
    )
    lr = float(model.get("lr") or 1e-3)
    p.add_argument(
        "--lr", type=number(float, 0), default=lr, help=f"peak learning rate (default {lr})"
    )
    compiled = model.get("precision") or "fp32"
    p.add_argument(
        "--dtype",
        choices=list(PRECISIONS),
        default=compiled,
        help=f"training precision (compiled: {compiled}); fp32 runs any package",
    )
    optimizer = str(plan.get("optimizer") or model.get("optimizer") or "adamw").lower()
    p.add_argument(
        "--optimizer", choices=sorted(OPTIMIZERS), default=optimizer, help=f"(default {optimizer})"
    )
    p.add_argument(
        "--weight-decay",
        type=number(float, 0),
        default=0.0,
        help="weight decay (AdamW's decoupled; L2 for sgd and adam); biases and norm weights "
        "(1-D tensors) get none (default %(default)s)",
    )
    p.add_argument("--adam-beta1", type=number(float, 0, below=1), default=0.9,
                   help="Adam's first-moment decay (default %(default)s)")  # fmt: skip
    p.add_argument("--adam-beta2", type=number(float, 0, below=1), default=0.999,
                   help="Adam's second-moment decay (default %(default)s)")  # fmt: skip
    p.add_argument("--adam-epsilon", type=number(float, 0), default=1e-8,
                   help="Adam's epsilon (default %(default)s)")  # fmt: skip
    p.add_argument(
        "--warmup",
        type=number(int, 0),
        default=0,
        help="steps of linear learning-rate warm-up, step k at lr*k/warmup (default %(default)s)",
    )
    p.add_argument(
        "--decay",
        choices=list(DECAYS),
        default="linear",
        help="learning-rate schedule after warm-up, as transformers' schedulers: "
        f"{', '.join(DECAYS)} (wsd: the peak, then linear to 0 over the last "
        "--decay-fraction of the steps; default %(default)s)",
    )
    p.add_argument(
        "--decay-fraction",
        type=_fraction,
        default=0.1,
        help="the part of the steps wsd decays over (default %(default)s)",
    )
    p.add_argument(
        "--clip",
        type=number(float, 0),
        default=1.0,
        help="max gradient norm; 0: no clipping (default %(default)s)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--init", default=None, help="a .pt state dict to start from (by name)")
    p.add_argument("--log-every", type=number(int, 1), default=1)


def _data(p, plan: dict) -> None:
    data = p.add_argument_group("data (README: fine-tuning)")
    data.add_argument(
        "--data",
        default=None,
        help=f"{' | '.join(SOURCES)} (default synthetic), a .pt / .jsonl of token "
        f"ids, or text: {' / '.join(TEXT_FORMATS)}",
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


def _checkpoints(p, plan: dict) -> None:
    ckpt = p.add_argument_group("checkpoints")
    ckpt.add_argument(
        "--save-every", type=number(int, 0), default=0, help="checkpoint every N steps (0: never)"
    )
    ckpt.add_argument(
        "--checkpoint-dir",
        default=None,
        help="where checkpoints go (default checkpoints/<model>-<plan hash>: one per plan)",
    )
    ckpt.add_argument(
        "--keep-checkpoints",
        type=number(int, 0),
        default=3,
        help="complete checkpoints kept, the newest (default 3; 0: all)",
    )
    start = ckpt.add_mutually_exclusive_group()  # a folder holds one run's checkpoints
    start.add_argument("--resume", action="store_true", help="continue from the newest checkpoint")
    start.add_argument(
        "--overwrite-checkpoints",
        action="store_true",
        help="a new run: remove the checkpoints of another run in --checkpoint-dir (default: "
        "refuse to start)",
    )


def _running(p, plan: dict) -> None:
    """Where the ranks run and how they meet and talk."""
    run = p.add_argument_group("processes")
    run.add_argument(
        "--timeout",
        type=number(float, 0, above=True),
        default=60.0,
        help="seconds without a heartbeat from a rank (killed, stopped, its machine lost) "
        "before the others give up on it (default 60); a rank that is only slow keeps beating, "
        "so no single wait has a deadline",
    )
    run.add_argument(
        "--hang-timeout",
        type=number(float, 0, above=True),
        default=1800.0,
        help="seconds in which no rank progresses, one of them busy (a hung kernel, a stuck "
        "disk), before the others stop naming it (default %(default)g); raise it for a step, "
        "a checkpoint or --save-hf that takes longer",
    )
    run.add_argument(
        "--post-ahead",
        type=number(float, 0),
        default=POST_AHEAD_BYTES / 2**20,
        help="MB of receive buffers posted ahead of need per peer, at most 64 "
        "messages (default %(default)g; 0: on demand)",
    )
    run.add_argument(
        "--device", choices=("cpu", "cuda"), default="cuda" if torch.cuda.is_available() else "cpu"
    )
    run.add_argument(
        "--tf32",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="fp32 matrix products on TF32 tensor cores (Ampere and later GPUs; the plan's fp32 "
        "costs assume it); --no-tf32: full fp32 (ftpipe_runtime.job.device)",
    )
    run.add_argument("--init-method", default="env://", help="torch.distributed rendezvous")
    run.add_argument(
        "--debug", action="store_true", help="print the traceback of an error before its sentence"
    )


def _outputs(p, plan: dict) -> None:
    out = p.add_argument_group("outputs")
    out.add_argument("--log-json", default=None, help="write losses and checksums here (rank 0)")
    out.add_argument(
        "--trace",
        default=None,
        help="write every rank's action start and end times here (rank 0; JSON "
        "for `ftpipe simulate plan.json --compare`)",
    )
    out.add_argument(
        "--log-dir", default=None, help="log.jsonl and TensorBoard scalars (where installed)"
    )
    out.add_argument(
        "--save-hf",
        default=None,
        help="write the trained model here as a HuggingFace folder (LoRA: peft's adapter folder)",
    )
    out.add_argument("--merge-lora", action="store_true", help=MERGE_HELP)
    out.add_argument(
        "--save-hf-every-checkpoint",
        action="store_true",
        help="also write each complete checkpoint as <save-hf>/step-N",
    )


def _freezing(p, plan: dict) -> None:
    freeze = p.add_argument_group(
        "freeze training (PipeTransformer §3.1; ftpipe_runtime.freeze.layers)"
    )
    freeze.add_argument(
        "--freeze-alpha",
        type=number(float, 0, above=True, below=1),
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


def _freeze_at(text: str) -> tuple[int, int]:
    try:
        return parse_freeze_at(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
