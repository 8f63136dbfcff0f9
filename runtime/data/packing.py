"""`--pack`: samples of a causal LM joined into full rows (`text.read_text` calls these).

    columns = end_documents(columns, eos=[2])        # each sample ended by end-of-sequence
    rows = pack_documents(columns, length=512)       # compiled with --pack: documents apart
    rows = concatenate(columns, length=512)          # compiled without: one stream, cut

A package compiled with `ftpipe compile --pack` takes position ids (ftpipe_runtime.models.
packing): whole samples are placed in rows (best fit decreasing: each, longest first, into
the row it fills best, so few rows are left part empty), each row's positions restart at 0
with every sample and its labels are IGNORE at a sample's first token, so every sample's loss
is what it would be alone. A sample longer than a row is refused, or cut with --truncate, as
unpacked. A package compiled without it has no input to tell samples apart: the stream of
samples is cut into rows, tokens attending across samples (what --pack did before).
"""

from __future__ import annotations

from bisect import bisect_left, insort

import torch

from ..models.packing import POSITIONS, positions, starts_ignored

__all__ = ["concatenate", "end_documents", "pack_documents"]


def end_documents(columns: dict, eos: list[int]) -> dict:
    """Every sample ended by the end-of-sequence token (unless it is already), in each column
    (the labels learn to predict it)."""
    add = [bool(eos) and row[-1:] != eos for row in columns["input_ids"]]
    return {k: [row + eos if a else row for row, a in zip(v, add)] for k, v in columns.items()}


def concatenate(columns: dict, length: int) -> dict:
    """One stream of every sample, cut into rows of `length`."""
    out = {}
    for column, rows in columns.items():
        flat = [t for row in rows for t in row]
        out[column] = list(torch.tensor(flat, dtype=torch.long).split(length))
    return out


def pack_documents(columns: dict, length: int) -> dict:
    """Whole samples (tensors no longer than `length`) in rows of at most `length` tokens:
    {"input_ids", "labels", "position_ids"}, one tensor per row (padded when batched)."""
    ids = columns["input_ids"]
    labels = columns.get("labels", ids)
    rows = _best_fit([len(r) for r in ids], length)
    out: dict[str, list[torch.Tensor]] = {"input_ids": [], "labels": [], POSITIONS: []}
    for row in rows:
        where = positions([len(ids[i]) for i in row])
        out["input_ids"].append(torch.cat([ids[i] for i in row]))
        out["labels"].append(starts_ignored(torch.cat([labels[i] for i in row]), where))
        out[POSITIONS].append(where)
    return out


def _best_fit(sizes: list[int], length: int) -> list[list[int]]:
    """Samples (indices) grouped into rows of at most `length`: longest first, each into the
    row with the least room that holds it (a new row if none), samples of a row in file order."""
    rows: list[list[int]] = []
    room: list[tuple[int, int]] = []  # (room left, row), sorted; full rows leave it
    for i in sorted(range(len(sizes)), key=lambda i: -sizes[i]):
        at = bisect_left(room, (sizes[i], -1))
        if at == len(room):
            rows.append([i])
            left, row = length - sizes[i], len(rows) - 1
        else:
            left, row = room.pop(at)
            rows[row].append(i)
            left -= sizes[i]
        if left > 0:
            insort(room, (left, row))
    return [sorted(r) for r in rows]
