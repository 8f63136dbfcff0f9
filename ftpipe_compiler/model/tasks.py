"""Tasks: the shapes a model is traced and trained with, by head kind.

    task = resolve_task(spec, "rte", seq_len=128)          # a preset (configs/tasks), reshaped
    task = resolve_task(spec, None, seq_len=2048)          # the model's default preset
    task.seq_len, task.target_len, task.micro_batch, task.batch

A preset names a head (`causal-lm`, `seq2seq-lm`, ...), a sequence length (and a target length
for seq2seq), a micro-batch and a batch: the paper's tasks (rte, boolq, wic, multirc, squad,
wikitext2) and one per head. `--seq-len`, `--target-len`, `--micro-batch` and `--batch` reshape
it; which inputs there are comes from the model (`ModelSpec.input_shapes`).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace

from ftpipe_runtime.models import get_head

from ..errors import FtpipeError, unknown
from ..resources import config_names, load_config


@dataclass(frozen=True)
class Task:
    name: str
    head: str  # "" for a module:function model
    seq_len: int
    target_len: int = 0  # decoder tokens of a seq2seq LM
    micro_batch: int = 1
    batch: int = 1
    optimizer: str = "adamw"
    lr: float = 1e-4
    description: str = ""

    @property
    def micro_batches(self) -> int:
        return max(1, self.batch // self.micro_batch)

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, d: dict) -> Task:
        return cls(**{k: d[k] for k in cls.__dataclass_fields__ if k in d})


def load_task(name: str) -> Task:
    d = load_config("tasks", name)
    if d is None:
        raise unknown("task", name, config_names("tasks"))
    return Task.from_json(d)


def resolve_task(
    spec,
    name: str | None = None,
    seq_len: int | None = None,
    target_len: int | None = None,
    micro_batch: int | None = None,
    batch: int | None = None,
) -> Task:
    """The preset `name` (default: the model's), reshaped by the explicit sizes given."""
    sizes = {"--seq-len": seq_len, "--target-len": target_len, "--micro-batch": micro_batch,
             "--batch": batch}  # fmt: skip
    if spec.kind == "function":
        given = [flag for flag, v in {"--task": name, **sizes}.items() if v is not None]
        if given:
            raise FtpipeError(
                f"{spec.spec} brings its own example inputs, so {given[0]} does not apply; "
                "change the shapes its function returns"
            )
        return spec.function_task()
    task = load_task(name or spec.default_task)
    if task.head != spec.head:
        fits = [n for n in config_names("tasks") if load_task(n).head == spec.head]
        raise FtpipeError(
            f"task {task.name!r} is for {task.head} models, and {spec.name} is a {spec.head} "
            f"({spec.hf_class}); choose one of {', '.join(fits)}, or leave --task out"
        )
    for flag, value in sizes.items():
        if value is not None and value < 1:
            raise FtpipeError(f"{flag} must be at least 1, not {value}")
    return reshape(task, spec, seq_len, target_len, micro_batch, batch)


def reshape(task: Task, spec, seq_len, target_len, micro_batch, batch) -> Task:
    """`task` with the sizes given (None: the task's own), checked against the model."""
    decoder = get_head(spec.head).decoder
    if target_len and not decoder:
        raise FtpipeError(f"--target-len is for seq2seq-lm models; {spec.name} is a {spec.head}")
    changed = {
        k: v
        for k, v in (("seq_len", seq_len), ("target_len", target_len if decoder else None))
        if v is not None and v != getattr(task, k)
    }
    mb = micro_batch or task.micro_batch
    if batch is None:  # keep the preset's number of micro-batches
        batch = task.batch if micro_batch is None else mb * task.micro_batches
    if batch % mb:
        raise FtpipeError(f"--batch {batch} is not a multiple of the micro-batch {mb}")
    name = task.name + "".join(f"@{k.split('_')[0]}{v}" for k, v in changed.items())
    task = replace(task, name=name, micro_batch=mb, batch=batch, **changed)
    if spec.max_positions and task.seq_len > spec.max_positions:
        raise FtpipeError(
            f"{spec.name} has {spec.max_positions} positions, fewer than the {task.seq_len} "
            f"tokens of task {task.name}; pass --seq-len {spec.max_positions} or less"
        )
    if decoder and task.target_len < 1:
        raise FtpipeError(f"task {task.name} has no target length; pass --target-len")
    return task
