"""A package's command lines, each parsed once into a typed, frozen record.

    config = RunConfig.parse(["--steps", "20", "--schedule", "gpipe"], plan)
    config.steps, config.lr, config.hyper, config.lr_at(k)
    ExportConfig.parse(["-o", "out"]).output          # `python -m <package> export`
    CheckConfig.parse(["--json"]).json                 # `python -m <package> --check`

`options.parser` says what each training option means and checks it (a usage error, exit 2);
the export's and --check's few options are declared here. These records are what the rest of
the runtime reads, nothing else: no `argparse.Namespace` travels further. The one value
settled later, `steps` (from `--epochs` once the data is counted), is set by `with_steps`,
which makes a new record.
"""

from __future__ import annotations

import argparse
from dataclasses import asdict, dataclass, fields, replace

from ..checkpoint.hf import MAX_SHARD, MERGE_HELP, shard_size
from ..train.optim import Hyper, lr_at

__all__ = ["CheckConfig", "ExportConfig", "RunConfig"]


def _record(cls, namespace: argparse.Namespace, **converted):
    """`cls` from a parser's namespace (`converted`: values given another form); an option
    without a field is a bug, said now."""
    given = vars(namespace)
    unknown = sorted(set(given) - {f.name for f in fields(cls)})
    if unknown:
        raise TypeError(f"{cls.__name__} has no field for the options {unknown}")
    return cls(**{**given, **converted})


@dataclass(frozen=True)
class RunConfig:
    """Every option of the package's command line (`options.parser`), by its dest name."""

    # training: how long, which schedule, which update rule
    steps: int | None = None  # None until `with_steps` (--epochs, or the default)
    epochs: float | None = None
    schedule: str | None = None  # None: the plan's
    micro_batches: int | None = None  # None: the plan's (or the schedule's)
    lr: float = 1e-3
    dtype: str = "fp32"
    optimizer: str = "adamw"
    offload_optimizer: bool = False
    offload_step: str | None = None  # exact | lagged (`spec.plan.OFFLOAD_STEPS`); None: the plan's
    shard_optimizer: bool | None = None  # across replicas (ZeRO-1); None: as the plan says
    offload_activations: bool = False  # every stage of the rank; else as the plan says
    offload_activations_min: float = 1.0  # MiB: smaller saved tensors stay on the device
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_epsilon: float = 1e-8
    warmup: int = 0
    decay: str = "linear"
    decay_fraction: float = 0.1
    clip: float = 1.0
    seed: int = 0
    init: str | None = None
    log_every: int = 1
    # data
    data: str | None = None
    eval_data: str | None = None
    eval_every: int = 0
    text_field: str | None = None
    prompt_field: str | None = None
    target_field: str | None = None
    weights: str | None = None
    chat_field: str | None = None
    chat_template: str | None = None
    tokenizer: str | None = None
    pack: bool = False
    truncate: bool = False
    shuffle_seed: int | None = None
    # checkpoints
    save_every: int = 0
    checkpoint_dir: str | None = None
    keep_checkpoints: int = 3
    resume: bool = False
    overwrite_checkpoints: bool = False
    # processes
    timeout: float = 60.0
    hang_timeout: float = 1800.0
    post_ahead: float = 256.0  # MB per peer
    device: str = "cpu"
    tf32: bool = True
    init_method: str = "env://"
    debug: bool = False
    # outputs
    log_json: str | None = None
    trace: str | None = None
    log_dir: str | None = None
    log_jsonl: str | None = None
    tensorboard: str | None = None
    wandb: str | None = None
    verbose: int = 0
    quiet: bool = False
    save_hf: str | None = None
    merge_lora: bool = False
    save_hf_every_checkpoint: bool = False
    # freeze training
    freeze_alpha: float | None = None
    freeze_every: int = 100
    freeze_at: tuple[tuple[int, int], ...] = ()
    no_shrink: bool = False

    @classmethod
    def parse(cls, argv, plan: dict, package: str = "<package>") -> RunConfig:
        """The command line `argv` of a package running `plan`; usage errors exit 2."""
        from .options import parser

        return cls.of(parser(plan, package).parse_args(list(argv)))

    @classmethod
    def of(cls, namespace) -> RunConfig:
        """From the parser's namespace; an option without a field here is a bug, said now."""
        freeze_at = tuple(tuple(d) for d in getattr(namespace, "freeze_at", None) or ())
        return _record(cls, namespace, freeze_at=freeze_at)

    def with_steps(self, steps: int) -> RunConfig:
        return replace(self, steps=steps)

    def to_dict(self) -> dict:
        return asdict(self)

    # --- what several parts of the run derive from the options, in one place ---
    @property
    def hyper(self) -> Hyper:
        """The optimizer's settings besides the learning rate."""
        return Hyper(self.weight_decay, (self.adam_beta1, self.adam_beta2), self.adam_epsilon)

    def lr_at(self, k: int, steps: int | None = None) -> float:
        """The learning rate at optimizer step k of `steps` (default: this run's)."""
        steps = self.steps if steps is None else steps
        return lr_at(k, self.lr, steps, self.warmup, self.decay, self.decay_fraction)

    @property
    def loudness(self) -> int:
        """-v's count less -q: the logging level's offset."""
        return self.verbose - int(self.quiet)


@dataclass(frozen=True)
class ExportConfig:
    """`python -m <package> export`: a checkpoint written as a HuggingFace folder
    (`checkpoint.hf.export_checkpoint`)."""

    output: str  # -o: the folder to write
    checkpoint_dir: str | None = None  # None: where training saves them
    step: int | None = None  # None: the newest complete one
    tokenizer: str | None = None  # None: the model's
    chat_template: str | None = None
    max_shard_size: int = shard_size(MAX_SHARD)  # bytes
    merge_lora: bool = False

    @classmethod
    def parse(cls, argv, prog: str = "export") -> ExportConfig:
        """The export's command line `argv`; usage errors exit 2."""
        p = argparse.ArgumentParser(
            prog=prog, description="Write a checkpoint as a HuggingFace folder."
        )
        p.add_argument("--checkpoint-dir", default=None, help="default: where training saves them")
        p.add_argument("--step", type=int, default=None, help="default: the newest complete one")
        p.add_argument("-o", "--output", required=True, help="the folder to write")
        p.add_argument("--tokenizer", default=None, help="tokenizer folder (default: the model's)")
        p.add_argument(
            "--chat-template", default=None, help="a Jinja chat template file to write beside it"
        )
        p.add_argument(
            "--max-shard-size", type=shard_size, default=MAX_SHARD, help=f"default {MAX_SHARD}"
        )
        p.add_argument("--merge-lora", action="store_true", help=MERGE_HELP)
        return _record(cls, p.parse_args(list(argv)))


@dataclass(frozen=True)
class CheckConfig:
    """`python -m <package> --check`: the stages against the original model (`check`)."""

    seed: int = 0  # of the synthetic inputs and weights
    json: bool = False  # print the result as JSON

    @classmethod
    def parse(cls, argv, prog: str = "--check") -> CheckConfig:
        """The --check command line `argv`; usage errors exit 2."""
        from . import check  # its docstring's first line describes it (check imports this)

        p = argparse.ArgumentParser(prog=prog, description=check.__doc__.split("\n")[0])
        p.add_argument(
            "--seed", type=int, default=0, help="of the synthetic inputs and weights (default 0)"
        )
        p.add_argument("--json", action="store_true", help="print the result as JSON")
        return _record(cls, p.parse_args(list(argv)))
