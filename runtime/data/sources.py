"""The fine-tuning side of a run: its data and evaluation set, the steps `--epochs` makes, and
the trained model written as a HuggingFace folder.

    sources = open_sources(plan, config, micro_batches=8, say=print)   # sources.steps: the run's
    sources.train.get("input_ids", mb=3); sources.eval.micro_batches
    exporter = HFExporter(plan, config, ckpt, say)                    # --save-hf
    exporter.after_checkpoint()          # rank 0: export checkpoints every rank has finished
    exporter.at_end(tensors, rank, ranks, device, dtype_of)         # gathers, rank 0 writes

Every rank opens the same files and derives the same order, so nothing is sent to share data.
Bad data (a missing file or field, an empty file, a text longer than the compiled length) is
refused here, before any rank waits for another.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from ..atomic import check_writable_folder
from ..checkpoint.hf import (
    check_exportable,
    check_replaceable,
    export_checkpoint,
    gather_tensors,
    write_hf_folder,
)
from ..checkpoint.store import Checkpoints
from ..errors import PipelineConfigError
from .batches import SOURCES, EvalData, TextOptions, make_data
from .text import is_text_file, load_tokenizer

if TYPE_CHECKING:  # the runtime's config is the job's; only its type is read here
    from ..job.config import RunConfig

__all__ = ["HFExporter", "Sources", "open_sources"]

DEFAULT_STEPS = 10


@dataclass
class Sources:
    train: object  # a data source (data.py): .get(name, mb)
    eval: EvalData | None
    text: TextOptions
    steps: int  # optimizer steps in all: --steps, or what --epochs makes of the data


def open_sources(plan: dict, config: RunConfig, micro_batches: int, say=print) -> Sources:
    """The run's training and evaluation data, and its steps (from --epochs if given)."""
    model = plan["model"]
    text = TextOptions(
        config.text_field, config.prompt_field, config.target_field, config.pack, config.truncate,
        chat_field=config.chat_field, chat_template=config.chat_template,
    )  # fmt: skip
    files = [f for f in (config.data, config.eval_data) if f and f not in SOURCES]
    inputs = model.get("inputs") or {}
    tokenizer = config.tokenizer or model.get("path")
    if any(Path(f).is_file() and is_text_file(f, inputs, text.given() or text.pack) for f in files):
        tokenizer = load_tokenizer(tokenizer)  # once, for both files
    seed = config.seed if config.shuffle_seed is None else config.shuffle_seed
    train = make_data(model, config.data, seed, text, tokenizer, say)
    evaluation = None
    if config.eval_data:
        evaluation = make_data(model, config.eval_data, seed, text, tokenizer, say, evaluation=True)
    elif config.eval_every:
        raise PipelineConfigError("--eval-every needs an evaluation set: pass --eval-data FILE")
    if config.epochs is not None:
        if not hasattr(train, "size"):
            raise PipelineConfigError("--epochs counts passes over a --data file; give --steps")
        micro_batch = next(iter(inputs.values()))[0][0]
        steps = max(1, math.ceil(config.epochs * train.size / (micro_batches * micro_batch)))
    else:
        steps = DEFAULT_STEPS if config.steps is None else config.steps
    return Sources(train, evaluation, text, steps)


class HFExporter:
    """`--save-hf DIR`: the trained model at the end; with `--save-hf-every-checkpoint`, each
    checkpoint all ranks finished, beside it as DIR-step-N (rank 0 reads it from the checkpoint
    folder, so that folder must be visible to rank 0: one node, or a shared file system)."""

    def __init__(self, plan: dict, config: RunConfig, ckpt: Checkpoints | None, say=print):
        self.plan, self.out, self.say = plan, Path(config.save_hf), say
        self.tokenizer = config.tokenizer
        self.chat_template = config.chat_template  # the export renders chat as training did
        self.merge_lora = config.merge_lora
        self.ckpt = ckpt if config.save_hf_every_checkpoint else None
        self.done: set[int] = set()
        if config.save_hf_every_checkpoint and not config.save_every:
            raise PipelineConfigError(
                "--save-hf-every-checkpoint needs checkpoints: pass --save-every N"
            )
        check_exportable(plan)
        if self.out.exists() and not self.out.is_dir():
            raise PipelineConfigError(f"--save-hf {self.out} is a file; give a folder")
        check_replaceable(self.out)  # the user's own files there: refused now, not at the end
        parent = self.out.absolute().parent
        if not parent.is_dir():
            raise PipelineConfigError(f"--save-hf {self.out}: the folder {parent} does not exist")
        check_writable_folder(parent, f"--save-hf {self.out}")

    def after_checkpoint(self) -> None:
        """Rank 0: export the checkpoints every rank has finished since the last call."""
        if self.ckpt is None:
            return
        for step, _ in self.ckpt.complete():
            if step not in self.done:
                self.done.add(step)
                out = self.out.with_name(f"{self.out.name}-step-{step:06d}")
                export_checkpoint(
                    self.plan, self.ckpt.root, step, out, self.tokenizer, say=self.say,
                    merge_lora=self.merge_lora, chat_template=self.chat_template,
                )  # fmt: skip
                self.say(f"wrote {out}")

    def at_end(self, tensors: dict, rank: int, ranks, device, dtype_of) -> None:
        """The ranks of rank 0's pipeline (`ranks`: by GPU): gather the stages' tensors; rank
        0 writes the folder."""
        everything = gather_tensors(self.plan, tensors, rank, ranks, device, dtype_of)
        if rank == 0:
            self.after_checkpoint()
            write_hf_folder(
                self.out, self.plan, everything, self.tokenizer, say=self.say,
                merge_lora=self.merge_lora, chat_template=self.chat_template,
            )  # fmt: skip
            self.say(f"wrote {self.out} (HuggingFace folder)")
