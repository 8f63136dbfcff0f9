"""Model inputs of any micro-batch, identical on every rank, read only where needed.

    data = make_data(plan["model"], source=None | "copy" | "train.pt" | "train.jsonl", seed=0)
    data.get("input_ids", mb=12)      # the tensor of global micro-batch 12 (CPU)

Synthetic data (the default) draws each input of each micro-batch from a generator seeded
by (seed, micro-batch, input name), so a rank makes only the inputs its stages read and
still agrees with every other rank. `copy` is a learnable synthetic task (counting
sequences; T5 copies its input) for watching an asynchronous loss fall. A file holds token
ids; every rank derives the same sample order (a seeded permutation per epoch).
"""

from __future__ import annotations

import json
import zlib
from pathlib import Path

import torch

from .errors import PipelineConfigError

IGNORE = -100  # label of padding: the loss skips it


class _Inputs:
    def __init__(self, model: dict, seed: int):
        try:
            self.specs = {n: (tuple(s), getattr(torch, d)) for n, (s, d) in model["inputs"].items()}
        except (KeyError, ValueError, TypeError, AttributeError) as e:
            raise PipelineConfigError(f"the plan's model inputs are unreadable ({e})") from None
        self.family = model.get("family", "")
        self.vocab = max(int(model.get("vocab_size") or 2), 2)
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

    def generator(self, name: str, mb: int) -> torch.Generator:
        return torch.Generator().manual_seed(
            (self.seed * 1_000_003 + mb) * 65_537 + zlib.crc32(name.encode())
        )

    def make(self, name: str, mb: int, batch: dict) -> torch.Tensor:
        raise NotImplementedError


class Synthetic(_Inputs):
    """Random token ids, attention masks of ones; GPT-2 labels are its inputs."""

    def make(self, name, mb, batch):
        shape, dtype = self.specs[name]
        gen = self.generator(name, mb)
        if name == "labels" and self.family == "gpt2" and "input_ids" in self.specs:
            return self.get("input_ids", mb).clone()
        if name == "attention_mask":
            return torch.ones(shape, dtype=dtype)
        if name == "token_type_ids":
            return torch.zeros(shape, dtype=dtype)
        if name in ("start_positions", "end_positions"):
            seq = self.specs["input_ids"][0][1] if "input_ids" in self.specs else 2
            return torch.randint(0, seq, shape, generator=gen).to(dtype)
        if dtype.is_floating_point:
            return torch.randn(shape, generator=gen).to(dtype)
        return torch.randint(0, self.vocab, shape, generator=gen).to(dtype)


class Copy(Synthetic):
    """Learnable: counting sequences (next token = this + 1); labels copy the inputs."""

    def make(self, name, mb, batch):
        shape, dtype = self.specs[name]
        if name == "input_ids" and len(shape) == 2:
            start = torch.randint(0, self.vocab, (shape[0], 1), generator=self.generator(name, mb))
            return ((start + torch.arange(shape[1])) % self.vocab).to(dtype)
        if name == "labels" and "input_ids" in self.specs:
            return self.get("input_ids", mb)[:, : shape[1]].clone().to(dtype)
        if name == "decoder_input_ids" and "labels" in self.specs:
            return shift_right(self.get("labels", mb)).to(dtype)
        if name in ("start_positions", "end_positions") and "input_ids" in self.specs:
            seq = self.specs["input_ids"][0][1]
            return (self.get("input_ids", mb)[:, 0] % seq).to(dtype)
        return super().make(name, mb, batch)


class FileData(_Inputs):
    """Samples of a tokenized file; missing inputs derived (masks, GPT-2 labels, T5 shifts)."""

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
        if name == "labels" and self.family == "gpt2":  # language modelling: predict the input
            ids = self.get("input_ids", mb).clone()
            return ids.masked_fill(~self.real(mb, ids.shape[1]), IGNORE).to(dtype)
        if name == "decoder_input_ids" and "labels" in self.specs:
            return shift_right(self.get("labels", mb)).to(dtype)
        if name == "token_type_ids":
            return torch.zeros(shape, dtype=dtype)
        raise PipelineConfigError(
            f"the data file has no {name!r} and it cannot be derived; give each sample as an "
            f"object with {', '.join(self.specs)}"
        )


def shift_right(labels: torch.Tensor, start: int = 0) -> torch.Tensor:
    """Decoder inputs of a T5-style model: the labels one position later, after `start`."""
    out = torch.full_like(labels, start)
    out[:, 1:] = labels[:, :-1]
    return out.masked_fill(out == IGNORE, 0)


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
