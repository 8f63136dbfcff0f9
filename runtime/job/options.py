"""The command line of a generated package (what `torchrun -m <package> ...` accepts).

    config = parse_args(["--steps", "20", "--schedule", "gpipe"], plan)   # a RunConfig

Defaults come from the plan: its schedule, micro-batches, optimizer and learning rate.
Every number is checked here (a usage error, exit code 2): `--lr nan`, `--timeout 0` or
`--save-every -1` never reach training.
"""

from __future__ import annotations

import argparse
import math
import os

import torch

from ..checkpoint.hf import MERGE_HELP
from ..data.batches import SOURCES
from ..data.text import TEXT_FORMATS
from ..engine.act_offload import MIN_BYTES
from ..engine.comm import POST_AHEAD_BYTES
from ..errors import ScheduleError
from ..freeze.layers import parse_freeze_at
from ..schedules import SCHEDULES, get_schedule
from ..spec.plan import OFFLOAD_STEPS
from ..spec.weights import WEIGHTS_ENV
from ..train.optim import DECAYS, OPTIMIZERS
from ..train.precision import PRECISIONS
from .config import RunConfig

MOST_MICRO_BATCHES = 2**16  # per step: each is a few actions in every step's lists
MOST_SECONDS = 10**9  # a wait's limit: 31 years, within what torch's timedelta takes


def _schedule(text: str) -> str:
    """A schedule's name, or a .csv file of per-GPU actions (read and checked by `run`)."""
    if text.lower().endswith(".csv"):
        return text
    try:
        get_schedule(text)
    except ScheduleError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def number(kind, low, above: bool = False, below=None, most=None):
    """An argparse type: an int or a finite float, at least `low` (greater with `above`),
    less than `below` and at most `most` when given."""

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
        if most is not None and value > most:
            raise argparse.ArgumentTypeError(f"{text} must be at most {most}")
        return value

    return parse


def use_weights(argv: list[str], prog: str) -> list[str]:
    """`--weights DIR` anywhere in `argv`: the model's folder for every command of the
    package (train, --check, export), through $FTPIPE_WEIGHTS so the stages and the plan's
    readers all see it. Returns `argv` without it (--check and export take no such option)."""
    pre = argparse.ArgumentParser(prog=prog, add_help=False, allow_abbrev=False)
    pre.add_argument("--weights", type=_folder, default=None)
    known, rest = pre.parse_known_args(argv)
    if known.weights is not None:
        os.environ[WEIGHTS_ENV] = known.weights
    return rest


def _folder(text: str) -> str:
    if not os.path.isdir(text):
        raise argparse.ArgumentTypeError(f"{text} is not a folder")
    return os.path.abspath(text)


def parse_args(argv, plan: dict, package: str = "<package>") -> RunConfig:
    """The run's settings (`config.RunConfig`) from the package's command line."""
    return RunConfig.of(parser(plan, package).parse_args(argv))


def parser(plan: dict, package: str = "<package>") -> argparse.ArgumentParser:
    """The package's command line; `--help` names the package and every option's default."""
    p = argparse.ArgumentParser(
        prog=f"python -m {package}",
        description=f"Fine-tune the pipeline: torchrun --nproc_per_node {plan.get('gpus', 'N')} "
        f"-m {package} [options] (README.md: multi-node and SLURM launches). Also: python -m "
        f"{package} --check [--help] runs the stages chained in one process against the "
        f"original model; python -m {package} export [--help] writes a checkpoint as a "
        "HuggingFace folder.",
        formatter_class=_Help,
    )
    for group in (_training, _data, _checkpoints, _running, _outputs, _freezing):
        group(p, plan)
    return p


class _Help(argparse.HelpFormatter):
    """Every option's default in its help: said in the help's own words where it says
    "default" (what a None stands for), else appended; a flag's default is off."""

    def _get_help_string(self, action) -> str:
        text = action.help or ""
        if "default" in text or not action.option_strings or action.nargs == 0:
            return text
        if action.default is None:
            return f"{text} (default: none)"
        return f"{text} (default %(default)s)"


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
        help="passes over --data instead of --steps (rounded up to whole steps; default: --steps)",
    )
    p.add_argument(
        "--schedule",
        type=_schedule,
        default=None,
        help=f"{', '.join(SCHEDULES)}, or a .csv file of per-GPU actions (default: the "
        f"plan's, {plan.get('schedule')})",
    )
    p.add_argument(
        "--micro-batches",
        type=number(int, 1, most=MOST_MICRO_BATCHES),
        default=None,
        help=f"per optimizer step (default: the plan's, {plan.get('micro_batches')})",
    )
    p.add_argument(
        "--lr",
        type=number(float, 0),
        default=float(model.get("lr") or 1e-3),
        help="peak learning rate",
    )
    compiled = model.get("precision") or "fp32"
    p.add_argument(
        "--dtype",
        choices=list(PRECISIONS),
        default=compiled,
        help=f"training precision; fp32 runs any package (default: the compiled {compiled})",
    )
    optimizer = str(plan.get("optimizer") or model.get("optimizer") or "adamw").lower()
    p.add_argument("--optimizer", choices=sorted(OPTIMIZERS), default=optimizer, help="update rule")
    p.add_argument(
        "--offload-optimizer",
        action="store_true",
        help="keep the master weights and optimizer state in host memory and step on the CPU "
        "(ftpipe_runtime.train.offload): less GPU memory, the same update",
    )
    p.add_argument(
        "--offload-step",
        choices=sorted(OFFLOAD_STEPS),
        default=None,
        help="where an offloaded stage's CPU step, run beside the rank's next actions, lands: "
        "exact, where its weights are next read (the same update as without offload), or "
        "lagged, at its next step (FTPipe's schedule only: one step more stale, the whole CPU "
        "step hidden); default: the plan's",
    )
    p.add_argument(
        "--shard-optimizer",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="with data-parallel replicas, each keeps 1/replicas of every stage's master weights "
        "and optimizer state, gradients reduce-scattered and weights all-gathered (ZeRO-1, "
        "ftpipe_runtime.train.zero): the same update; --no-shard-optimizer: none (default: the "
        "stages the plan shards)",
    )
    p.add_argument(
        "--offload-activations",
        action="store_true",
        help="park every stage's saved activations in host memory between its forward and "
        "its backward, fetched one backward ahead (ftpipe_runtime.engine.act_offload; the "
        "plan may ask it per stage): less GPU memory, the same update",
    )
    p.add_argument(
        "--offload-activations-min",
        type=number(float, 0),
        default=MIN_BYTES / 2**20,
        metavar="MIB",
        help="saved tensors under this size stay on the device (default %(default)s MiB)",
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
        type=number(float, 0, most=1),
        default=0.1,
        help="the part of the steps wsd decays over (default %(default)s)",
    )
    p.add_argument(
        "--clip",
        type=number(float, 0),
        default=1.0,
        help="max gradient norm; 0: no clipping (default %(default)s)",
    )
    p.add_argument(
        "--seed",
        type=number(int, -(2**31), below=2**31),
        default=0,
        help="dropout, synthetic data and sample order",
    )
    p.add_argument(
        "--init",
        default=None,
        help="a .pt or .safetensors state dict to start from, by name (default: the compiled "
        "weights)",
    )
    p.add_argument("--log-every", type=number(int, 1), default=1, help="a step line every N steps")


def _data(p, plan: dict) -> None:
    data = p.add_argument_group("data (README: fine-tuning)")
    data.add_argument(
        "--data",
        default=None,
        help=f"{' | '.join(SOURCES)} (default synthetic), a .pt / .jsonl of token "
        f"ids, or text: {' / '.join(TEXT_FORMATS)}",
    )
    data.add_argument(
        "--eval-data", default=None, help="a file like --data, evaluated in order (default: none)"
    )
    data.add_argument(
        "--eval-every",
        type=number(int, 0),
        default=0,
        help="evaluate every N steps; 0: at the end",
    )
    data.add_argument("--text-field", default=None, help="the field of the text (default text)")
    data.add_argument(
        "--prompt-field", default=None, help="with --target-field: loss on targets only"
    )
    data.add_argument("--target-field", default=None, help="with --prompt-field: the target")
    data.add_argument(
        "--weights",
        type=_folder,
        default=None,
        help=f"the model's folder: its *.safetensors (and tokenizer) where the package does not "
        f"find them (default: the folder it was compiled from, relative to the package; "
        f"or ${WEIGHTS_ENV})",
    )
    data.add_argument(
        "--chat-field",
        default=None,
        help="causal LM: the field of a sample's {role, content} messages (e.g. messages), "
        "rendered with the chat template; loss on the assistant turns only",
    )
    data.add_argument(
        "--chat-template",
        default=None,
        help="a Jinja chat template file for --chat-field (default: the tokenizer's)",
    )
    data.add_argument(
        "--tokenizer", default=None, help="tokenizer folder (default: the compiled model's)"
    )
    data.add_argument(
        "--pack",
        action="store_true",
        help="causal LM: join texts into full rows (documents kept apart if compiled with --pack)",
    )
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
        "--save-every", type=number(int, 0), default=0, help="checkpoint every N steps; 0: never"
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
        help="a new run: replace the checkpoints of another run in --checkpoint-dir, kept aside "
        "until this run's first checkpoint is complete (default: refuse to start)",
    )


def _running(p, plan: dict) -> None:
    """Where the ranks run and how they meet and talk."""
    run = p.add_argument_group("processes")
    run.add_argument(
        "--timeout",
        type=number(float, 0, above=True, most=MOST_SECONDS),
        default=60.0,
        help="seconds without a heartbeat from a rank (killed, stopped, its machine lost) "
        "before the others give up on it (default 60); a rank that is only slow keeps beating, "
        "so no single wait has a deadline",
    )
    run.add_argument(
        "--hang-timeout",
        type=number(float, 0, above=True, most=MOST_SECONDS),
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
        "--device",
        choices=("cpu", "cuda"),
        default="cuda" if torch.cuda.is_available() else "cpu",
        help="where the stages run (default: cuda where there is one, else cpu)",
    )
    run.add_argument(
        "--tf32",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="fp32 matrix products on TF32 tensor cores (Ampere and later GPUs; the plan's fp32 "
        "costs assume it); --no-tf32: full fp32 (ftpipe_runtime.job.device)",
    )
    run.add_argument(
        "--init-method", default="env://", help="torch.distributed rendezvous (torchrun's)"
    )
    run.add_argument(
        "--debug", action="store_true", help="print the traceback of an error before its sentence"
    )


def _outputs(p, plan: dict) -> None:
    out = p.add_argument_group("outputs")
    out.add_argument(
        "--log-json", default=None, help="the run's summary: losses, checksums, memory (rank 0)"
    )
    out.add_argument(
        "--trace",
        default=None,
        help="write every rank's action start and end times here (rank 0; JSON "
        "for `ftpipe simulate plan.json --compare`)",
    )
    out.add_argument(
        "--log-dir",
        default=None,
        help="a folder for log.jsonl and tensorboard/ (TensorBoard where installed)",
    )
    out.add_argument(
        "--log-jsonl",
        default=None,
        metavar="FILE",
        help="every step's figures as one JSON object a line (rank 0; default "
        "<log-dir>/log.jsonl with --log-dir, else none)",
    )
    out.add_argument(
        "--tensorboard",
        default=None,
        metavar="DIR",
        help="TensorBoard scalars here (needs the tensorboard package; default "
        "<log-dir>/tensorboard with --log-dir, else none)",
    )
    out.add_argument(
        "--wandb",
        default=None,
        metavar="PROJECT",
        help="log to this Weights & Biases project (needs the wandb package; WANDB_MODE=offline "
        "keeps the run on disk)",
    )
    loud = out.add_mutually_exclusive_group()
    loud.add_argument(
        "-v",
        "--verbose",
        action="count",
        default=0,
        help="more lines: debugging detail on rank 0, INFO on the other ranks",
    )
    loud.add_argument(
        "-q",
        "--quiet",
        action="store_true",
        help="warnings and errors only: no step lines, no progress bar",
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
        help="also write each complete checkpoint as a folder beside --save-hf DIR: DIR-step-NNNNNN",
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
