"""Text for fine-tuning: files read with HuggingFace `datasets`, tokenized by the model's tokenizer.

    opts = TextOptions(prompt_field="question", target_field="answer")
    columns = read_text("train.jsonl", plan["model"], opts, tokenizer_folder)
    # {"input_ids": [tensor, ...], "labels": [tensor, ...]}: rows of token ids, for FileData

Formats by suffix: `.jsonl` / `.json`, `.csv`, `.parquet` (a field per column) and `.txt` (a
sample per line, the field `text`), loaded with `datasets` from the local file (nothing is
downloaded) and tokenized with `AutoTokenizer` from the model's own folder (or `--tokenizer`).

What a sample becomes depends on the model's head:

- causal LM, `--text-field` (default `text`): the tokens; the model predicts every one.
- causal LM, `--prompt-field/--target-field`: prompt then target then end-of-sequence; labels
  are -100 on the prompt, so the loss counts the target only.
- seq2seq LM (`--prompt-field/--target-field`): source tokens in, target tokens as labels.
- causal LM, `--chat-field` (e.g. `messages`): a list of {role, content} messages rendered
  with the chat template (the tokenizer's, or `--chat-template FILE`); labels on the
  assistant turns only (`chat.py`).

Samples are padded to the compiled length; `pack=True` (causal LM) joins them, each ended by
the end-of-sequence token, into full rows instead (`packing.py`: whole samples kept apart by
their positions in a package compiled with --pack, else one stream cut into rows). A sample
longer than the compiled length is refused, naming it; `truncate=True` cuts it with a warning.
"""

from __future__ import annotations

import json
import random
import tempfile
from dataclasses import dataclass
from itertools import islice
from pathlib import Path

import torch

from ..errors import PipelineConfigError
from ..models import IGNORE
from ..models.packing import packs_documents
from .chat import chat_columns, chat_template, template_name
from .checks import check_data_file, check_lines, check_utf8
from .packing import concatenate, end_documents, pack_documents

__all__ = [
    "TEXT_FORMATS",
    "TextOptions",
    "has_tokenizer",
    "is_text_file",
    "load_tokenizer",
    "read_text",
    "text_columns",
]

TEXT_FORMATS = {".jsonl": "json", ".json": "json", ".csv": "csv", ".parquet": "parquet",
                ".txt": "text"}  # fmt: skip
TEXT_HEADS = ("causal-lm", "seq2seq-lm")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json",
                   "spiece.model", "vocab.txt")  # fmt: skip
PEEK = 16  # the .jsonl lines `is_text_file` looks at for one that tells text from token ids


@dataclass(frozen=True)
class TextOptions:
    text_field: str | None = None  # None: "text"
    prompt_field: str | None = None
    target_field: str | None = None
    pack: bool = False
    truncate: bool = False
    chat_field: str | None = None  # a list of {role, content} messages per sample (chat.py)
    chat_template: str | None = None  # a Jinja file instead of the tokenizer's template

    @property
    def pairs(self) -> bool:
        return self.prompt_field is not None or self.target_field is not None

    def given(self) -> bool:
        return self.text_field is not None or self.pairs or self.chat_field is not None

    def fields(self) -> list[str]:
        """The fields a sample is read from, after checking that they go together."""
        if self.chat_field is not None and (self.text_field is not None or self.pairs):
            raise PipelineConfigError(
                "--chat-field is the whole sample; leave out --text-field, --prompt-field and "
                "--target-field"
            )
        if self.chat_template and self.chat_field is None:
            raise PipelineConfigError("--chat-template renders --chat-field; pass --chat-field")
        if self.pairs and not (self.prompt_field and self.target_field):
            raise PipelineConfigError("give both --prompt-field and --target-field, or neither")
        if self.chat_field is not None:
            return [self.chat_field]
        return [self.prompt_field, self.target_field] if self.pairs else [self.text_field or "text"]

    def to_json(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if v not in (None, False)}


def is_text_file(path, model_inputs=(), text: bool = False) -> bool:
    """Whether `path` holds text (else token ids: `.pt`, or `.jsonl` of id lists). A `.jsonl`
    is text when its first record is an object naming no model input (`input_ids`...), token
    ids when it is a list or names one. One that shows neither (blank, not UTF-8, no line of
    JSON among the first) is text when the text options are given (`text`): the reader of
    what the user meant then names what is wrong with it, not the other kind's reader."""
    suffix = Path(path).suffix
    if suffix not in TEXT_FORMATS:
        return False
    if suffix != ".jsonl":
        return True
    ids = {"input_ids", "labels", "decoder_input_ids", *model_inputs}
    try:
        with open(path, encoding="utf-8-sig", errors="replace") as f:  # (only a peek)
            for line in islice((line for line in f if line.strip()), PEEK):
                try:
                    record = json.loads(line)
                except ValueError:
                    continue  # a broken line is the reader's to name; a later one may tell
                if isinstance(record, list):
                    return False
                if isinstance(record, dict):
                    return not ids & set(record)
    except OSError:
        pass
    return text


def has_tokenizer(folder) -> bool:
    """Whether `folder` holds a tokenizer's files (`TOKENIZER_FILES`)."""
    return bool(folder) and any((Path(folder) / f).is_file() for f in TOKENIZER_FILES)


def load_tokenizer(folder):
    """The model's tokenizer (`AutoTokenizer`) from `folder`, or one sentence saying why not."""
    if not has_tokenizer(folder):
        where = f"{folder} has no tokenizer files" if folder else "the plan names no model folder"
        raise PipelineConfigError(
            f"text data needs the model's tokenizer, and {where}; pass --tokenizer FOLDER "
            "(a folder written by tokenizer.save_pretrained)"
        )
    try:
        import transformers
        from transformers import AutoTokenizer
    except ImportError:
        raise PipelineConfigError(
            "text data needs transformers and datasets: pip install 'ftpipe[hf]'"
        ) from None
    transformers.logging.set_verbosity_error()
    try:
        return AutoTokenizer.from_pretrained(str(folder))
    except Exception as e:  # noqa: BLE001 - many library errors, one meaning
        raise PipelineConfigError(
            f"cannot load the tokenizer in {folder} ({type(e).__name__}: {_short(e)})"
        ) from None


def read_text(path, model: dict, options: TextOptions, tokenizer, say=print) -> dict:
    """Token-id columns of the text file `path` for the plan's `model` (see the module doc)."""
    path = Path(path)
    columns = text_columns(path, model.get("head", ""), options, tokenizer)
    lengths = {n: shape[1] for n, (shape, _) in model["inputs"].items() if len(shape) > 1}
    if not options.pack:
        return _fit(columns, lengths, path.name, options.truncate, say)
    learnable = _learnable(columns, path, say) if options.chat_field is not None else None
    columns = end_documents(columns, _eos(tokenizer))
    if packs_documents(model):
        rows = _fit(columns, {"input_ids": lengths["input_ids"]}, path.name, options.truncate, say)
        return pack_documents(_kept(rows, learnable), lengths["input_ids"])
    say(
        f"ftpipe: note: {path.name}: this package was compiled without --pack, so packed texts "
        "attend to each other and their positions run on; compile with `ftpipe compile --pack` "
        "to keep them apart"
    )
    return concatenate(_kept(columns, learnable), lengths["input_ids"])


def _learnable(columns: dict, path: Path, say) -> list[bool] | None:
    """Which conversations have a token to learn before packing gives each an end-of-sequence
    label (else one without an assistant turn would teach the model to end a user's turn);
    unpacked, such samples are left out where the batches are made, with a note alike."""
    mask = [any(t != IGNORE for t in row) for row in columns["labels"]]
    if all(mask):
        return None
    say(
        f"ftpipe: note: {path}: left out {mask.count(False)} conversations with nothing to "
        "learn (no assistant turn)"
    )
    return mask


def _kept(columns: dict, mask: list[bool] | None) -> dict:
    """The rows `mask` keeps (after `_fit`, whose messages number the samples as the file)."""
    if mask is None:
        return columns
    return {k: [r for r, keep in zip(rows, mask) if keep] for k, rows in columns.items()}


def text_columns(path, head: str, options: TextOptions, tokenizer, samples: int | None = None):
    """Each sample's token ids, uncut and unpadded: {"input_ids": [[...], ...], "labels"?}.
    `samples`: at most this many, drawn at random (seeded) when the file has more (what
    `ftpipe compile --data` measures lengths on)."""
    path = Path(path)
    if head not in TEXT_HEADS:
        raise PipelineConfigError(
            f"text data is for causal-lm and seq2seq-lm models, and this one is a "
            f"{head or 'model without a head'}; give a .pt or .jsonl file of token ids"
        )
    fields = options.fields()
    if head == "seq2seq-lm" and not options.pairs:
        raise PipelineConfigError(
            f"{path.name}: a seq2seq model learns targets from sources; pass --prompt-field "
            "and --target-field"
        )
    if options.pack and head != "causal-lm":
        raise PipelineConfigError("--pack joins texts for a causal LM; leave it out here")
    rows, index = _read_rows(path, fields, chat=options.chat_field is not None, samples=samples)
    if options.chat_field is not None:
        template = chat_template(tokenizer, options.chat_template)
        talks = rows[fields[0]]
        columns = chat_columns(
            tokenizer, talks, template, lambda i: _where(path, index[i]), options.chat_template
        )
        if samples is None:  # (a sample of the file may lack the assistant turns it has)
            _check_learnable(path, talks, columns["labels"], options.chat_template)
        return columns
    if head == "seq2seq-lm":
        return {
            "input_ids": _ids(tokenizer, rows[fields[0]]),
            "labels": _ids(tokenizer, rows[fields[1]]),
        }
    return _causal(tokenizer, rows, fields, options.pairs)


def _read_rows(path: Path, fields: list[str], chat: bool = False, samples: int | None = None):
    """The fields' values of the samples kept, and each one's row in the file. Text samples
    with an empty field are left out; chat samples (lists, checked by chat.py) are all kept."""
    check_data_file(path)
    builder = TEXT_FORMATS[path.suffix]
    if builder != "parquet":  # the others are text
        check_utf8(path)
    try:
        import datasets
    except ImportError:
        raise PipelineConfigError(
            "text data needs datasets and transformers: pip install 'ftpipe[hf]'"
        ) from None
    datasets.disable_progress_bars()
    datasets.logging.set_verbosity(datasets.logging.CRITICAL)  # errors: one sentence, ours
    try:  # a private cache: ranks do not share (or lock) one, and nothing stays behind
        with tempfile.TemporaryDirectory(prefix="ftpipe-data-") as cache:
            table = datasets.load_dataset(
                builder, data_files=str(path), split="train", cache_dir=cache, keep_in_memory=True
            )
    except Exception as e:  # noqa: BLE001 - arrow, json and csv parsers raise many types
        if path.suffix == ".jsonl":  # arrow counts rows from the start of its block, not the file
            check_lines(path)
        cause = e.__cause__ or e.__context__ or e
        raise PipelineConfigError(
            f"{path} cannot be read as {builder} ({type(cause).__name__}: {_short(cause)})"
        ) from None
    if table.num_rows == 0:
        raise PipelineConfigError(f"{path} is empty; give one sample per line or row")
    missing = [f for f in fields if f not in table.column_names]
    if missing:
        raise PipelineConfigError(
            f"{path} has no field {missing[0]!r} (it has {', '.join(table.column_names)}); "
            "name the text with --text-field, a pair with --prompt-field and --target-field, "
            "or chat messages with --chat-field"
        )
    rows = list(range(table.num_rows))
    if samples is not None and len(rows) > samples:
        rows = sorted(random.Random(0).sample(rows, samples))  # a seeded subset, in file order
    # Each sample's values as a list, aligned with `rows`: reading a column whole is 4x
    # faster than reading it value by value, which only pays for a small subset.
    out = {f: list(table[f]) if len(rows) == table.num_rows else [table[f][i] for i in rows]
           for f in fields}  # fmt: skip
    for f, values in out.items():  # arrow fills a field a sample lacks with None
        lacks = next((j for j, v in enumerate(values) if v is None), None)
        if lacks is not None:
            raise PipelineConfigError(_no_value(path, rows[lacks], f, _flag(f, fields, chat)))
    if chat:
        return out, rows
    for f, values in out.items():
        bad = next((j for j, v in enumerate(values) if not isinstance(v, str)), None)
        if bad is not None:
            raise PipelineConfigError(
                f"{path} sample {rows[bad] + 1}: field {f!r} holds {type(values[bad]).__name__}, "
                "not text"
            )
    keep = [j for j in range(len(rows)) if all(out[f][j].strip() for f in fields)]
    if not keep:
        raise PipelineConfigError(f"{path} holds only empty texts")
    return {f: [v[j] for j in keep] for f, v in out.items()}, [rows[j] for j in keep]


def _where(path: Path, row: int, line=None) -> str:
    """Sample `row` (from 0) named as a person finds it: its line in a .jsonl (`line`, when
    the caller found it already: `_line`), else its number."""
    line = line or _line(path, row)
    return f"{path} line {line[0]}" if line else f"{path} sample {row + 1}"


def _line(path: Path, row: int) -> tuple[int, str] | None:
    """Sample `row`'s line number and text in a .jsonl (None in another format)."""
    if path.suffix != ".jsonl":
        return None
    with open(path, encoding="utf-8-sig") as f:  # datasets skips blank lines; count them here
        seen = -1
        for line_number, line in enumerate(f, 1):
            seen += bool(line.strip())
            if seen == row:
                return line_number, line
    return None


def _flag(field: str, fields: list[str], chat: bool) -> str:
    """The option that named `field` (`fields`: as `TextOptions.fields` gives them)."""
    if chat:
        return "--chat-field"
    if len(fields) == 2:
        return ("--prompt-field", "--target-field")[fields.index(field)]
    return "--text-field"


def _no_value(path: Path, row: int, field: str, flag: str) -> str:
    """The sentence for sample `row` without a value in `field`: the fields its line has
    instead (a field named differently in some lines), or that it is null or empty."""
    line = _line(path, row)
    where = _where(path, row, line)
    try:
        record = json.loads(line[1]) if line else None
    except ValueError:
        record = None
    if isinstance(record, dict) and field not in record:
        return (
            f"{where} has no field {field!r} (it has {', '.join(record) or 'none'}); give "
            f"every sample the field {flag} names"
        )
    return f"{where} has no value in field {field!r}; give it one, or leave the sample out"


def _check_learnable(path: Path, talks: list, labels: list, template_file) -> None:
    """Chat data whose labels are all ignored trains on nothing (or, packed, only on the
    end-of-sequence token each conversation gets): one sentence saying why instead."""
    if any(t != IGNORE for row in labels for t in row):
        return
    if not any(m.get("role") == "assistant" for talk in talks for m in talk):
        raise PipelineConfigError(
            f"{path}: no conversation has an assistant turn to learn from (the loss is on the "
            "assistant's messages only); give conversations with assistant replies"
        )
    raise PipelineConfigError(
        f"{path}: {template_name(template_file)} never renders the assistant messages' content, so there is "
        "nothing to learn; give a template that writes them (--chat-template FILE)"
    )


def _ids(tokenizer, texts: list[str], special: bool = True) -> list[list[int]]:
    return tokenizer(texts, add_special_tokens=special)["input_ids"]


def _eos(tokenizer) -> list[int]:
    return [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []


def _causal(tokenizer, rows, fields, pairs: bool) -> dict[str, list[list[int]]]:
    if not pairs:
        return {"input_ids": _ids(tokenizer, rows[fields[0]])}
    prompts = _ids(tokenizer, rows[fields[0]])
    targets = [t + _eos(tokenizer) for t in _ids(tokenizer, rows[fields[1]], special=False)]
    return {
        "input_ids": [p + t for p, t in zip(prompts, targets)],
        "labels": [[IGNORE] * len(p) + t for p, t in zip(prompts, targets)],
    }


def _fit(columns: dict, lengths: dict, name: str, truncate: bool, say) -> dict:
    """Rows no longer than the compiled lengths: refused, or cut with a warning."""
    cut = set()  # the samples cut (a sample's labels are cut with its tokens: counted once)
    for column, rows in columns.items():
        limit = lengths.get(column, lengths["input_ids"])
        seq2seq = column == "labels" and "decoder_input_ids" in lengths
        flag = "--target-len" if seq2seq else "--seq-len"
        for i, row in enumerate(rows):
            if len(row) <= limit:
                continue
            if not truncate:
                raise PipelineConfigError(
                    f"{name} sample {i + 1} has {len(row)} tokens of {column}, more than the "
                    f"{limit} the package was compiled for; pass --truncate to cut such texts, "
                    f"or compile again with a longer {flag}"
                )
            rows[i] = row[:limit]
            cut.add(i)
    if cut:
        say(f"ftpipe: warning: {name}: cut {len(cut)} texts to the compiled length (--truncate)")
    return {k: [torch.tensor(r, dtype=torch.long) for r in v] for k, v in columns.items()}


def _short(e: BaseException) -> str:
    text = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    return text if len(text) < 160 else text[:160] + "..."
