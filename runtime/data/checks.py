"""Whether a data file can be read at all, before a reader parses it: there, not a folder,
not empty or blank; text in UTF-8 (not UTF-16, no NUL byte); a .jsonl one JSON object a line.
Each says what is wrong in one sentence naming the file and, where it applies, its line.

    check_data_file(path)   # no data file x.jsonl / x.jsonl is empty / holds only blank lines
    check_utf8(path)        # x.csv line 3 (byte 13) is not UTF-8 text (...); save it as UTF-8
    check_lines(path)       # x.jsonl line 15001 is not JSON (...); after a parser failed
"""

from __future__ import annotations

import codecs
import json
from pathlib import Path

from ..errors import PipelineConfigError

__all__ = ["check_data_file", "check_lines", "check_utf8"]


def check_data_file(path) -> None:
    """A data file that is there and holds something, or one sentence: no such file, a
    folder, empty, or (a text file) only blank lines."""
    path = Path(path)
    if path.is_dir():
        raise PipelineConfigError(f"the data file {path} is a folder; give a file")
    if not path.is_file():
        raise PipelineConfigError(f"no data file {path}")
    if path.stat().st_size == 0:
        raise PipelineConfigError(f"{path} is empty; give one sample per line or row")
    # (a .txt of blank lines is samples of empty text, and says so when read)
    if path.suffix in (".jsonl", ".json", ".csv") and _blank(path):
        raise PipelineConfigError(
            f"{path} holds no samples, only blank lines; give one sample per line or row"
        )


def _blank(path: Path, chunk: int = 1 << 20) -> bool:
    """Whether the file holds only whitespace (and a byte-order mark): read only until the
    first other byte, so a file with samples costs one read."""
    with open(path, "rb") as f:
        piece = f.read(chunk).removeprefix(codecs.BOM_UTF8)
        while piece:
            if piece.strip():
                return False
            piece = f.read(chunk)
    return True


def check_utf8(path: Path, chunk: int = 1 << 20) -> None:
    """A text file is UTF-8 without NUL bytes, or one sentence naming its first other byte.
    pyarrow's readers take such a file and fail only when a row is read back (a raw
    UnicodeDecodeError), and a NUL is a binary file's, never text's (the tokenizer would make
    it an unknown word), so every byte is checked here first, a megabyte at a time."""
    decoder = codecs.getincrementaldecoder("utf-8")()
    read = lines = 0  # bytes read before this piece, and the line ends among them
    with open(path, "rb") as f:
        if utf16 := _utf16(f.read(64)):
            raise PipelineConfigError(
                f"{path} is not UTF-8 text but UTF-16 ({utf16}); save the file as UTF-8"
            )
        f.seek(0)
        while True:
            piece = f.read(chunk)
            held = len(decoder.getstate()[0])  # the start of a character cut by the last piece
            try:
                decoder.decode(piece, final=not piece)
            except UnicodeDecodeError as e:
                at = read - held + e.start  # the bad byte's offset in the file
                line = lines + piece[: max(at - read, 0)].count(b"\n") + 1
                raise PipelineConfigError(
                    f"{path} line {line} (byte {at}) is not UTF-8 text ({e.reason}); save the "
                    "file as UTF-8"
                ) from None
            if not piece:
                return
            if (nul := piece.find(b"\0")) >= 0:
                line = lines + piece[:nul].count(b"\n") + 1
                raise PipelineConfigError(
                    f"{path} line {line} (byte {read + nul}) holds a NUL byte, which text does "
                    "not; is it a binary file? save the text as UTF-8"
                )
            read += len(piece)
            lines += piece.count(b"\n")


def _utf16(head: bytes) -> str:
    """Why the file's first bytes look like UTF-16 (Windows' "Unicode"), or "": its
    byte-order mark, or ASCII with a NUL byte beside every character. Named as such, not as
    its first byte that is not UTF-8 or its first NUL."""
    if head.startswith((codecs.BOM_UTF32_LE, codecs.BOM_UTF32_BE)):
        return ""  # (UTF-32: its NULs and bad bytes are named as they are)
    if head.startswith((codecs.BOM_UTF16_LE, codecs.BOM_UTF16_BE)):
        return "it begins with UTF-16's byte-order mark"
    pairs = len(head) // 2
    for nul in (0, 1):  # big- or little-endian
        if pairs >= 2 and all(
            head[2 * i + nul] == 0 and head[2 * i + 1 - nul] for i in range(pairs)
        ):
            return "a NUL byte beside every character"
    return ""


def check_lines(path: Path) -> None:
    """One sentence naming the first line of a .jsonl that is not a JSON object, if one is."""
    with open(path, encoding="utf-8-sig") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line.rstrip("\r\n"))  # (its end is no control character)
            except json.JSONDecodeError as e:
                what = f"{e.msg.removesuffix(' at')} at column {e.colno}"  # ("starting at")
                raise PipelineConfigError(
                    f"{path} line {number} is not JSON ({what}); give one JSON object per line"
                ) from None
            if not isinstance(record, dict):
                raise PipelineConfigError(
                    f"{path} line {number} holds a JSON {_JSON_KINDS.get(type(record), 'value')}, "
                    "not an object; give one JSON object of fields per line"
                )


_JSON_KINDS = {list: "array", str: "string", int: "number", float: "number", bool: "boolean",
               type(None): "null"}  # fmt: skip
