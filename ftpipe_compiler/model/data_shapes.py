"""Shapes from the data (`ftpipe compile --data FILE`): the sequence length (and a seq2seq
model's target length) a percentile of the data's token lengths asks for.

    shapes = data_shapes(spec, "train.jsonl", TextOptions(chat_field="messages"))
    shapes.seq_len, shapes.target_len      # the 99th percentile, rounded up to a multiple of 8
    print(shapes.line())                   # what was chosen, what it cuts, what padding wastes

The file is read and tokenized exactly as the package will read it (the runtime's
`ftpipe_runtime.data.text.text_columns`, with the model folder's tokenizer), on at most
`SAMPLES` samples drawn at random (seeded); a file of token ids (`.pt`, `.jsonl` of id lists)
is measured as it is. The percentile is the nearest-rank one: the
smallest length at least that share of the samples fit in. Rounding up to a multiple of 8
keeps the matrix shapes friendly to tensor cores. A length the user gave wins; it is measured
the same way (how many samples it cuts, how much it pads). With `--pack` rows are full rows of
the sequence length, so the data does not choose it: the task's (or `--seq-len`) stays.
"""

from __future__ import annotations

import math
import random
from dataclasses import asdict, dataclass
from pathlib import Path

from ftpipe_runtime.data.checks import check_data_file
from ftpipe_runtime.data.text import (
    TextOptions,
    has_tokenizer,
    is_text_file,
    load_tokenizer,
    text_columns,
)
from ftpipe_runtime.data.tokens import read_token_ids
from ftpipe_runtime.errors import PipelineConfigError

from ..errors import FtpipeError

__all__ = ["SAMPLES", "DataRequest", "DataShapes", "Measured", "data_shapes", "length_at"]

SAMPLES = 2000  # samples tokenized to measure: enough for a 99th percentile, seconds to read
MULTIPLE = 8


@dataclass(frozen=True)
class DataRequest:
    """What `compile --data` was given: the file, how to read it, which percentile to fit."""

    path: str
    text: TextOptions
    percentile: float = 99.0


@dataclass(frozen=True)
class Measured:
    """One column's length: chosen (or given), and what it does to the samples measured."""

    flag: str  # "--seq-len" or "--target-len"
    length: int
    given: bool  # the user's length, not the data's
    longest: int
    cut: int  # samples longer than `length`
    waste: float  # share of the padded rows' tokens that are padding
    wanted: int = 0  # the percentile's length when the model's positions capped it

    def describe(self, percentile: float, samples: int) -> str:
        why = "given" if self.given else f"percentile {percentile:g}, rounded up to {MULTIPLE}"
        if self.wanted:
            why = f"percentile {percentile:g} is {self.wanted}, more than the model's positions"
        return (
            f"{self.flag} {self.length} ({why}; longest {self.longest}): {self.cut} of {samples} "
            f"samples longer, padding {self.waste:.1%} of the tokens"
        )


@dataclass(frozen=True)
class DataShapes:
    data: str
    percentile: float
    samples: int  # measured
    seq: Measured | None  # None: --pack (full rows; the length is not the data's)
    target: Measured | None  # a seq2seq model's decoder side
    tokens: int = 0  # in the samples measured
    row: int | None = None  # --pack: a row's tokens (--seq-len or the task's)
    too_long: int = 0  # --pack: samples longer than a row (refused by the run, or --truncate)

    @property
    def seq_len(self) -> int | None:
        return self.seq.length if self.seq is not None and not self.seq.given else None

    @property
    def target_len(self) -> int | None:
        return self.target.length if self.target is not None and not self.target.given else None

    def line(self) -> str:
        """One line: the lengths chosen, the samples they cut, the padding they waste."""
        if self.seq is None:
            line = (
                f"data {Path(self.data).name}: {self.samples} samples measured, {self.tokens} "
                "tokens; --pack puts whole samples into full rows, so the sequence length is "
                "not the data's: the task's, or --seq-len"
            )
            if self.row and self.too_long:
                return (
                    f"{line}; {self.too_long} of {self.samples} samples are longer than a row "
                    f"of {self.row} tokens: the run refuses them unless --truncate cuts them "
                    "(or compile with a larger --seq-len)"
                )
            return f"{line}; every sample fits a row of {self.row} tokens" if self.row else line
        parts = [m.describe(self.percentile, self.samples) for m in (self.seq, self.target) if m]
        return f"data {Path(self.data).name}: " + "; ".join(parts)

    def to_json(self) -> dict:
        return asdict(self)


def length_at(lengths: list[int], percentile: float) -> int:
    """The nearest-rank percentile of `lengths` rounded up to a multiple of 8."""
    ranked = sorted(lengths)
    at = ranked[max(0, math.ceil(percentile / 100 * len(ranked)) - 1)]
    return -(-at // MULTIPLE) * MULTIPLE


def data_shapes(spec, data, options: TextOptions, *, percentile: float = 99.0,
                seq_len: int | None = None, target_len: int | None = None,
                samples: int = SAMPLES) -> DataShapes:  # fmt: skip
    """The lengths `data` asks of the model `spec` (a ModelSpec with a folder and a head);
    `seq_len` / `target_len`: the user's, measured but kept."""
    if not 0 < percentile <= 100:
        raise FtpipeError(f"--len-percentile must be in (0, 100], not {percentile}")
    try:
        columns = _columns(spec, Path(data), options, samples)
    except PipelineConfigError as e:
        raise FtpipeError(str(e)) from None
    ids = [len(r) for r in columns["input_ids"]]
    if options.pack:  # `seq_len`: the row's length
        too_long = sum(n > seq_len for n in ids) if seq_len else 0
        return DataShapes(str(data), percentile, len(ids), None, None, sum(ids), seq_len, too_long)
    seq = _measure("--seq-len", ids, percentile, seq_len, spec.max_positions)
    target = None
    if spec.head == "seq2seq-lm" and "labels" in columns:
        targets = [len(r) for r in columns["labels"]]
        target = _measure("--target-len", targets, percentile, target_len, 0)
    return DataShapes(str(data), percentile, len(ids), seq, target, sum(ids))


def _columns(spec, data: Path, options: TextOptions, samples: int) -> dict:
    """Each sample's token ids: text tokenized as the package will, or a file of token ids."""
    check_data_file(data)  # before telling text from token ids, which it cannot
    if not is_text_file(data, text=options.given()):
        if options.given():
            raise FtpipeError(f"{data} holds token ids; the text options are for text")
        columns = read_token_ids(data)
        rows = range(len(next(iter(columns.values()))))
        rows = sorted(random.Random(0).sample(rows, min(samples, len(rows))))
        return {k: [v[i].reshape(-1).tolist() for i in rows] for k, v in columns.items()}
    if spec.kind == "function" or not spec.path:
        raise FtpipeError(
            f"--data measures text with the model's tokenizer, and {spec.name} has no model "
            "folder; give --model a HuggingFace folder (with its tokenizer)"
        )
    if not has_tokenizer(spec.path):
        # compile has no --tokenizer: the package takes one when it runs
        raise FtpipeError(
            f"--data measures text with the model's tokenizer, and the model folder "
            f"{spec.path} has no tokenizer files; save the tokenizer into it "
            "(tokenizer.save_pretrained), or compile without --data (choosing --seq-len) and "
            "run the package with --tokenizer FOLDER"
        )
    tokenizer = load_tokenizer(spec.path)
    return text_columns(data, spec.head, options, tokenizer, samples=samples)


def _measure(flag, lengths, percentile, given, positions) -> Measured:
    length = given or length_at(lengths, percentile)
    wanted = length if positions and not given and length > positions else 0
    length = min(length, positions) if wanted else length  # the model takes no more
    cut = sum(n > length for n in lengths)
    waste = 1 - sum(min(n, length) for n in lengths) / (length * len(lengths))
    return Measured(flag, length, bool(given), max(lengths), cut, waste, wanted)
