"""Model inputs of any micro-batch, identical on every rank, read only where needed.

    data = make_data(plan["model"], source=None | "copy" | "train.pt" | "train.jsonl", seed=0)
    data.get("input_ids", mb=12)      # the tensor of global micro-batch 12 (CPU)
    text = make_data(plan["model"], "qa.csv", 0, TextOptions(prompt_field="q", target_field="a"),
                     tokenizer="path/to/model")

Synthetic data (the default) is `ftpipe_runtime.models.synthetic_batch`, the very inputs the
compiler traced with and a package's `--check` compares on: each input of each micro-batch
drawn from a generator seeded by (seed, micro-batch, input name), so every rank agrees. `copy`
is a learnable synthetic task (counting sequences; labels follow from them) for watching an
asynchronous loss fall. A file holds token ids (`.pt`, `.jsonl` of id lists) or text
(`.jsonl`, `.json`, `.csv`, `.parquet`, `.txt`: `text_data` tokenizes it with the model's
tokenizer); every rank derives the same sample order (a seeded permutation per epoch); inputs
it lacks follow from the model's head (masks, causal-LM labels, seq2seq decoder inputs, the
positions of rows that hold one sample each). An
evaluation set (`evaluation=True`) is read once, in order, by `EvalData`.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from ..errors import PipelineConfigError, unknown_name
from ..models import HEADS, IGNORE, Vocab, decoder_inputs, shift_right, synthetic_batch
from ..models.packing import POSITIONS
from .checks import check_data_file
from .text import (
    TEXT_FORMATS,
    TextOptions,
    is_text_file,
    load_tokenizer,
    read_text,
)
from .tokens import TOKEN_COLUMNS, read_token_ids

__all__ = ["IGNORE", "SOURCES", "EvalData", "FileData", "TextOptions", "make_data", "shift_right"]


class _Inputs:
    def __init__(self, model: dict, seed: int):
        try:
            self.specs = {n: (tuple(s), getattr(torch, d)) for n, (s, d) in model["inputs"].items()}
        except (KeyError, ValueError, TypeError, AttributeError) as e:
            raise PipelineConfigError(f"the plan's model inputs are unreadable ({e})") from None
        self.model = model
        self.head = HEADS.get(model.get("head") or "")
        self.vocab = Vocab.from_json(model.get("vocab"))
        self.seed = seed
        self._cache: dict[int, dict[str, torch.Tensor]] = {}

    def get(self, name: str, mb: int) -> torch.Tensor:
        batch = self._cache.get(mb)
        if batch is None:
            batch = self._cache[mb] = {}
            if len(self._cache) > 8:  # micro-batches are read by a few nearby actions only
                del self._cache[min(self._cache)]
        if name not in batch:
            if name not in self.specs:
                raise PipelineConfigError(
                    f"no model input {name!r}; the plan has {list(self.specs)}"
                )
            batch[name] = self.make(name, mb, batch)
        return batch[name]

    def peek(self, name: str, mb: int) -> torch.Tensor:
        """Input `name` of micro-batch `mb`, made afresh unless cached, and not cached: a
        step's labels counted ahead (`train.loss_weights`) leave the cache to the
        micro-batches being trained (filling it so grew a rank's peak by 90 MB)."""
        batch = self._cache.get(mb, {})
        return batch[name] if name in batch else self.make(name, mb, {})

    def make(self, name: str, mb: int, batch: dict) -> torch.Tensor:
        raise NotImplementedError


class Synthetic(_Inputs):
    """Random token ids, rows ending in some padding, labels as the head has them."""

    counting = False

    def make(self, name, mb, batch):
        batch.update(synthetic_batch(self.model, mb, self.seed, counting=self.counting))
        return batch[name]  # the other inputs of the micro-batch are in `batch` now too


class Copy(Synthetic):
    """Learnable: counting sequences (next token = this + 1); labels follow from them."""

    counting = True


class FileData(_Inputs):
    """Samples of a tokenized file; missing inputs derived (masks, causal-LM labels, decoder inputs).

    Everything is checked when the file is opened, before training: token ids inside the
    vocabulary, every input present or derivable. Samples with nothing to predict (one
    token for a causal LM, labels all padding) are left out with a warning: a micro-batch
    of only such samples would have a loss of 0/0 = NaN.
    """

    def __init__(self, model: dict, seed: int, columns: dict, path: str, say=None):
        super().__init__(model, seed)
        self.columns = columns
        vocab = (model.get("vocab") or {}).get("vocab_size") if isinstance(model, dict) else None
        _check_vocabulary(self.columns, int(vocab or 0), path)
        keep = [r for r in range(_rows(self.columns)) if self._has_target(r)]
        if not keep:
            raise PipelineConfigError(
                f"{path}: no sample has a token to predict (a language model needs 2 or more "
                "tokens per sample)"
            )
        if len(keep) < _rows(self.columns):
            dropped = _rows(self.columns) - len(keep)
            (say or _warn)(
                f"ftpipe: note: {path}: left out {dropped} samples with nothing to predict"
            )
            self.columns = {k: [v[r] for r in keep] for k, v in self.columns.items()}
        self.size = len(keep)
        self.micro_batch = next(iter(self.specs.values()))[0][0]
        self._perms: dict[int, torch.Tensor] = {}
        for name in self.specs:  # a missing input is an error now, not at some later step
            self.get(name, 0)

    def _has_target(self, r: int) -> bool:
        if "labels" not in self.specs:
            return True
        if "labels" in self.columns:
            return bool((self.columns["labels"][r].reshape(-1) != IGNORE).any())
        if "input_ids" in self.columns and self.head is not None and self.head.labels_are_input_ids:
            return self.columns["input_ids"][r].numel() >= 2
        return True

    def rows(self, mb: int) -> list[int]:
        first = mb * self.micro_batch
        out = []
        for i in range(first, first + self.micro_batch):
            epoch, at = divmod(i, self.size)
            if epoch not in self._perms:
                gen = torch.Generator().manual_seed(self.seed * 7919 + epoch)
                self._perms = {epoch: torch.randperm(self.size, generator=gen)}
            out.append(int(self._perms[epoch][at]))
        return out

    def row(self, name: str, r: int | None) -> torch.Tensor:
        """Sample r of a column; None: an empty row (padding only)."""
        return self.columns[name][r].reshape(-1) if r is not None else torch.zeros(0, dtype=int)

    def real(self, mb: int, length: int) -> torch.Tensor:
        """True where a row of micro-batch `mb` has a token, False on its padding."""
        lengths = [len(self.row("input_ids", r)) for r in self.rows(mb)]
        return torch.arange(length) < torch.tensor(lengths)[:, None]

    def make(self, name, mb, batch):
        shape, dtype = self.specs[name]
        if name in self.columns:
            pad = IGNORE if name == "labels" else 0
            return _stack([self.row(name, r) for r in self.rows(mb)], shape, pad).to(dtype)
        if name == "attention_mask" and "input_ids" in self.columns:
            return self.real(mb, shape[1]).to(dtype)
        if name == "labels" and self.head is not None and self.head.labels_are_input_ids:
            ids = batch["input_ids"] if "input_ids" in batch else self.make("input_ids", mb, batch)
            ids = ids.clone()
            return ids.masked_fill(~self.real(mb, ids.shape[1]), IGNORE).to(dtype)
        if name == "decoder_input_ids" and "labels" in self.specs:
            return decoder_inputs(
                self.get("labels", mb), self.vocab, self.model.get("model_type", "")
            )
        if name == "token_type_ids":
            return torch.zeros(shape, dtype=dtype)
        if name == POSITIONS:  # rows not packed, on a package compiled for packing: one each
            return torch.arange(shape[1]).expand(shape).to(dtype)
        raise PipelineConfigError(
            f"the data file has no {name!r} and it cannot be derived; give each sample as an "
            f"object with {', '.join(self.specs)}"
        )


class EvalData(FileData):
    """An evaluation set: every sample once, in file order. The last micro-batch is filled
    up with empty rows (all padding: masked, and ignored by the loss); `weight(mb)` counts
    the real ones, so a mean over micro-batches weighs each sample once."""

    @property
    def micro_batches(self) -> int:
        return -(-self.size // self.micro_batch)

    def rows(self, mb: int) -> list[int | None]:
        first = (mb % self.micro_batches) * self.micro_batch
        return [i if i < self.size else None for i in range(first, first + self.micro_batch)]

    def weight(self, mb: int) -> int:
        return sum(r is not None for r in self.rows(mb))


def _stack(rows: list[torch.Tensor], shape, pad: int) -> torch.Tensor:
    """Rows cut or padded to the traced shape (shapes are fixed by tracing)."""
    out = torch.full(shape, pad, dtype=torch.long)
    for i, r in enumerate(rows):
        if len(shape) == 1:  # one value per sample: answer positions
            out[i] = r[0] if len(r) else pad
        else:
            out[i, : min(len(r), shape[1])] = r[: shape[1]]
    return out


def _rows(columns: dict) -> int:
    return len(next(iter(columns.values())))


def _check_vocabulary(columns: dict, vocab: int, path) -> None:
    """Token ids must index the embedding table: 0 <= id < vocab (labels may be -100)."""
    if vocab <= 0:
        return
    for name in TOKEN_COLUMNS:
        for i, row in enumerate(columns.get(name, ())):
            values = row.reshape(-1)
            if name == "labels":
                values = values[values != IGNORE]
            bad = values[(values < 0) | (values >= vocab)]
            if bad.numel():
                raise PipelineConfigError(
                    f"{path}: sample {i} has {name} {int(bad[0])}, outside the vocabulary "
                    f"0..{vocab - 1} of the model"
                )


SOURCES = {"synthetic": Synthetic, "copy": Copy}
FILE_SUFFIXES = (".pt", *TEXT_FORMATS)


def make_data(
    model: dict,
    source: str | None,
    seed: int,
    text: TextOptions | None = None,
    tokenizer=None,
    say=None,
    evaluation: bool = False,
) -> _Inputs:
    """The inputs of `source`: a name of SOURCES, a file of token ids, or a text file
    (tokenized by `tokenizer`, a folder or a loaded tokenizer; see `text_data`).
    `evaluation`: every sample once, in order (`EvalData`); a file only."""
    text = text or TextOptions()
    if evaluation and (source is None or source in SOURCES):
        raise PipelineConfigError("--eval-data takes a file of text or of token ids")
    if source is None or source in SOURCES:
        if text.given() or text.pack:
            raise PipelineConfigError("the text options need --data FILE of text")
        return SOURCES[source or "synthetic"](model, seed)
    if not source.endswith(FILE_SUFFIXES):
        raise PipelineConfigError(
            unknown_name(
                "data",
                source,
                SOURCES,
                f", a .pt / .jsonl file of token ids or a {' / '.join(TEXT_FORMATS)} file of text",
            )
        )
    check_data_file(source)  # before telling text from token ids, which it cannot
    if is_text_file(source, model.get("inputs") or {}, text.given() or text.pack):
        if isinstance(tokenizer, (str, Path)) or tokenizer is None:
            tokenizer = load_tokenizer(tokenizer)
        columns = read_text(source, model, text, tokenizer, say or _warn)
    elif text.given() or text.pack:
        raise PipelineConfigError(f"{source} holds token ids; the text options are for text")
    else:
        columns = read_token_ids(Path(source))
    return (EvalData if evaluation else FileData)(model, seed, columns, source, say)


def _warn(line: str) -> None:
    print(line, file=sys.stderr, flush=True)
