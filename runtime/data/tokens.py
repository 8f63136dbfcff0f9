"""Files of token ids, read into columns of rows: `.pt` (a 2-d integer tensor or a dict of
them) or `.jsonl` (each line a list of ids or an object of such lists). Whatever is wrong
with a file is one sentence naming it (`PipelineConfigError`); `torch.load` reads tensors
only (`weights_only`).

    columns = read_token_ids(Path("train.pt"))    # {"input_ids": [tensor, ...], ...}
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from ..checkpoint.files import load_pickled
from ..errors import PipelineConfigError
from .checks import check_data_file, check_utf8

__all__ = ["TOKEN_COLUMNS", "read_token_ids"]


def read_token_ids(path: Path) -> dict[str, list[torch.Tensor]]:
    """Columns of token-id rows from `.pt` (a 2-d tensor or a dict of them) or `.jsonl`."""
    check_data_file(path)
    if path.suffix == ".pt":
        cols = _read_pt(path)
    elif path.suffix == ".jsonl":
        cols = _read_jsonl(path)
    else:
        raise PipelineConfigError(f"{path}: data files are .pt or .jsonl of token ids")
    sizes = {len(v) for v in cols.values()}
    if not cols or len(sizes) != 1 or 0 in sizes:
        raise PipelineConfigError(f"{path}: every column needs the same, non-zero number of rows")
    return cols


def _read_pt(path: Path) -> dict[str, list[torch.Tensor]]:
    try:
        obj = load_pickled(path)
    except Exception as e:  # noqa: BLE001 - empty, truncated, not a torch file, a pickle
        raise PipelineConfigError(
            f"{path} is not a torch file of token ids ({type(e).__name__}); save a 2-d integer "
            "tensor or a dict of them with torch.save"
        ) from None
    if isinstance(obj, torch.Tensor):
        obj = {"input_ids": obj}
    if not isinstance(obj, dict) or not obj:
        raise PipelineConfigError(f"{path}: expected a tensor or a dict of tensors")
    cols = {}
    for k, v in obj.items():
        if isinstance(v, torch.Tensor) and v.dim() == 0:
            raise PipelineConfigError(f"{path}: {k!r} is a single number; give one row per sample")
        rows = [torch.as_tensor(r) for r in v] if isinstance(v, (torch.Tensor, list, tuple)) else []
        if not all(r.dtype in _INTEGERS for r in rows):
            raise PipelineConfigError(
                f"{path}: {k!r} holds {rows[0].dtype if rows else type(v).__name__} values; "
                "token ids are integers"
            )
        cols[k] = rows
    return cols


def _read_jsonl(path: Path) -> dict[str, list[torch.Tensor]]:
    cols: dict[str, list[torch.Tensor]] = {}
    check_utf8(path)  # a byte that is not UTF-8 is one sentence, not a column of garbage
    with open(path, encoding="utf-8-sig") as f:  # (a byte-order mark is skipped)
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                row = row if isinstance(row, dict) else {"input_ids": row}
                for k, v in row.items():
                    if not _integers(v):
                        raise ValueError(f"{k!r} is not a list of integers")
                    cols.setdefault(k, []).append(torch.tensor(v, dtype=torch.long))
            except ValueError as e:  # json.JSONDecodeError is a ValueError
                raise PipelineConfigError(
                    f"{path} line {number}: {e}; each line is a list of token ids or an object "
                    "of such lists"
                ) from None
    return cols


_INTEGERS = (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8)
TOKEN_COLUMNS = ("input_ids", "decoder_input_ids", "labels")


def _integers(v) -> bool:
    if isinstance(v, list):
        return all(_integers(x) for x in v)
    return isinstance(v, int) and not isinstance(v, bool)
