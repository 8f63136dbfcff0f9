"""Packed rows that keep their documents apart: what a row holds, for any causal LM.

    packs_documents(plan["model"])         # compiled with --pack: position ids in, no 2-D mask
    positions([3, 5], length=10)           # tensor([0, 1, 2, 0, 1, 2, 3, 4, 0, 1])
    starts_ignored(labels, positions)      # labels with IGNORE at each document's first token

A causal LM compiled with `ftpipe compile --pack` is traced with `position_ids` and without
the 2-D `attention_mask` (`heads.input_names(..., packed=True)`). Given positions and no mask,
transformers' masking (`masking_utils.find_packed_sequence_indices`, whose graph torch.export
keeps) starts a new document wherever a position does not follow the one before it, and
builds the causal mask block-diagonal: a token attends to the earlier tokens of its own
document only, and rotary or learned position embeddings restart at 0 with each document. The
labels of a document's first token are IGNORE, so the last token of one document is never
trained to predict the next one (torchtune's and TRL's rule). A row's padding (after its last
document) is a run of positions of its own: nothing real attends to it, its labels are IGNORE.
"""

from __future__ import annotations

import torch

from .heads import IGNORE

__all__ = ["POSITIONS", "packs_documents", "positions", "starts_ignored"]

POSITIONS = "position_ids"


def packs_documents(model: dict) -> bool:
    """Whether a plan's model keeps packed documents apart: it takes position ids and no 2-D
    attention mask (the mask is derived from the positions)."""
    inputs = model.get("inputs") or {}
    return POSITIONS in inputs and "attention_mask" not in inputs


def positions(lengths, length: int | None = None) -> torch.Tensor:
    """Each document's positions 0, 1, ... one after the other; filled up to `length` with a
    run of its own (the row's padding)."""
    lengths = [int(n) for n in lengths]
    if length is not None and length > sum(lengths):
        lengths.append(length - sum(lengths))
    if not lengths:
        return torch.zeros(0, dtype=torch.long)
    ends = torch.tensor(lengths).cumsum(0)
    index = torch.arange(int(ends[-1]))
    return index - (ends - torch.tensor(lengths)).repeat_interleave(torch.tensor(lengths))


def starts_ignored(labels: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
    """`labels` with IGNORE where a document starts (position 0): the model shifts labels by
    one, so the token before it (the previous document's last) predicts nothing."""
    return labels.masked_fill(position_ids == 0, IGNORE)
