"""Model inputs of any micro-batch, identical on every rank, read only where needed.

    data = make_data(plan["model"], source=None | "copy" | "train.pt" | "train.jsonl", seed=0)
    data.get("input_ids", mb=12)      # the tensor of global micro-batch 12 (CPU)

Synthetic data (the default) is `ftpipe_runtime.models.synthetic_batch`, the very inputs the
compiler traced with and a package's `--check` compares on: each input of each micro-batch
drawn from a generator seeded by (seed, micro-batch, input name), so every rank agrees. `copy`
is a learnable synthetic task (counting sequences; labels follow from them) for watching an
asynchronous loss fall. A file holds token ids; every rank derives the same sample order (a
seeded permutation per epoch); inputs it lacks follow from the model's head (masks, causal-LM
labels, seq2seq decoder inputs).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from .errors import PipelineConfigError
from .models import HEADS, IGNORE, Vocab, decoder_inputs, shift_right, synthetic_batch

__all__ = ["IGNORE", "SOURCES", "make_data", "shift_right"]


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
    """Samples of a tokenized file; missing inputs derived (masks, causal-LM labels, decoder inputs)."""

    def __init__(self, model: dict, seed: int, path: str):
        super().__init__(model, seed)
        self.columns = _read(Path(path))
        self.size = len(next(iter(self.columns.values())))
        self.micro_batch = next(iter(self.specs.values()))[0][0]
        self._perms: dict[int, torch.Tensor] = {}

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

    def real(self, mb: int, length: int) -> torch.Tensor:
        """True where a row of micro-batch `mb` has a token, False on its padding."""
        lengths = [len(self.columns["input_ids"][r].reshape(-1)) for r in self.rows(mb)]
        return torch.arange(length) < torch.tensor(lengths)[:, None]

    def make(self, name, mb, batch):
        shape, dtype = self.specs[name]
        if name in self.columns:
            pad = IGNORE if name == "labels" else 0
            return _stack([self.columns[name][r] for r in self.rows(mb)], shape, pad).to(dtype)
        if name == "attention_mask" and "input_ids" in self.columns:
            return self.real(mb, shape[1]).to(dtype)
        if name == "labels" and self.head is not None and self.head.labels_are_input_ids:
            ids = self.get("input_ids", mb).clone()
            return ids.masked_fill(~self.real(mb, ids.shape[1]), IGNORE).to(dtype)
        if name == "decoder_input_ids" and "labels" in self.specs:
            return decoder_inputs(
                self.get("labels", mb), self.vocab, self.model.get("model_type", "")
            )
        if name == "token_type_ids":
            return torch.zeros(shape, dtype=dtype)
        raise PipelineConfigError(
            f"the data file has no {name!r} and it cannot be derived; give each sample as an "
            f"object with {', '.join(self.specs)}"
        )


def _stack(rows: list[torch.Tensor], shape, pad: int) -> torch.Tensor:
    """Rows cut or padded to the traced shape (shapes are fixed by tracing)."""
    out = torch.full(shape, pad, dtype=torch.long)
    for i, r in enumerate(rows):
        r = r.reshape(-1)
        if len(shape) == 1:  # one value per sample: answer positions
            out[i] = r[0]
        else:
            out[i, : min(len(r), shape[1])] = r[: shape[1]]
    return out


def _read(path: Path) -> dict[str, list[torch.Tensor]]:
    """Columns of token-id rows from `.pt` (a 2-d tensor or a dict of them) or `.jsonl`."""
    if not path.is_file():
        raise PipelineConfigError(f"no data file {path}")
    if path.suffix == ".pt":
        obj = torch.load(path, map_location="cpu", weights_only=True)
        if isinstance(obj, torch.Tensor):
            obj = {"input_ids": obj}
        if not isinstance(obj, dict):
            raise PipelineConfigError(f"{path}: expected a tensor or a dict of tensors")
        cols = {k: [torch.as_tensor(r) for r in v] for k, v in obj.items()}
    elif path.suffix == ".jsonl":
        cols = {}
        with open(path) as f:
            rows = [json.loads(line) for line in f if line.strip()]
        for row in rows:
            row = row if isinstance(row, dict) else {"input_ids": row}
            for k, v in row.items():
                cols.setdefault(k, []).append(torch.tensor(v, dtype=torch.long))
    else:
        raise PipelineConfigError(f"{path}: data files are .pt or .jsonl of token ids")
    sizes = {len(v) for v in cols.values()}
    if not cols or len(sizes) != 1 or 0 in sizes:
        raise PipelineConfigError(f"{path}: every column needs the same, non-zero number of rows")
    return cols


SOURCES = {"synthetic": Synthetic, "copy": Copy}


def make_data(model: dict, source: str | None, seed: int) -> _Inputs:
    if source is None or source in SOURCES:
        return SOURCES[source or "synthetic"](model, seed)
    if source.endswith((".pt", ".jsonl")):
        return FileData(model, seed, source)
    raise PipelineConfigError(
        f"unknown data {source!r}; choose from {', '.join(SOURCES)} or a .pt / .jsonl file"
    )
