"""Synthetic inputs of any micro-batch: one function for the compiler, `--check` and training.

    batch = synthetic_batch(plan["model"], index=12, seed=0)   # {"input_ids": ..., "labels": ...}

`model` is the plan's model description: `inputs` (name -> [shape with the micro-batch, dtype]),
`head`, `model_type` and `vocab` (`Vocab.to_json()`). Each input of micro-batch `index` is drawn from a
generator seeded by (seed, index, its name), so every rank, the compiler and the check make
the same tensors. Rows end in padding (row r in min(r, seq / 8) tokens), masked in the
attention mask and ignored in the labels, so the mask path is exercised too; a model compiled
for packed documents (`packing.py`) gets rows of 1 to 4 documents instead, cut at drawn points,
their positions restarting. `counting=True`
makes a learnable task instead: counting sequences (next token = this + 1), labels that
follow from them.
"""

from __future__ import annotations

import zlib

import torch

from .heads import HEADS, IGNORE, Vocab, family_rule
from .packing import POSITIONS, packs_documents, positions, starts_ignored

MASKED_LM_FRACTION = 0.15  # of the tokens a masked LM predicts (BERT's)


def synthetic_batch(model: dict, index: int = 0, seed: int = 0, counting: bool = False) -> dict:
    return _Draw(model, index, seed, counting).all()


def shift_right(labels: torch.Tensor, start: int = 0, pad: int = 0) -> torch.Tensor:
    """Decoder inputs of a seq2seq LM: `start`, then the labels one position later, ignored
    positions as padding (what BART's, T5's... own `shift_tokens_right` computes)."""
    out = torch.full_like(labels, start)
    out[:, 1:] = labels[:, :-1]
    return out.masked_fill(out == IGNORE, pad)


def shift_wrap_last(labels: torch.Tensor, start: int = 0, pad: int = 0) -> torch.Tensor:
    """mBART's decoder inputs: the last token that is not padding first, then the labels one
    position later (`start` is unused: the language id at the end of the target starts)."""
    ids = labels.masked_fill(labels == IGNORE, pad)
    last = (ids.ne(pad).sum(1, keepdim=True) - 1).clamp(min=0)
    out = torch.empty_like(ids)
    out[:, 1:] = ids[:, :-1]
    out[:, :1] = ids.gather(1, last)
    return out


SHIFTS = {"right": shift_right, "wrap-last": shift_wrap_last}


def decoder_inputs(labels: torch.Tensor, vocab: Vocab, model_type: str = "") -> torch.Tensor:
    """The decoder inputs a seq2seq LM of `model_type` makes from its labels."""
    shift = SHIFTS[family_rule(model_type, "shift", "right")]
    return shift(labels, vocab.decoder_start_token_id, vocab.pad_token_id)


class _Draw:
    def __init__(self, model: dict, index: int, seed: int, counting: bool):
        self.specs = {n: (tuple(s), getattr(torch, d)) for n, (s, d) in model["inputs"].items()}
        self.head = HEADS.get(model.get("head") or "")
        self.vocab = Vocab.from_json(model.get("vocab"))
        self.model_type = model.get("model_type", "")
        self.packed = packs_documents(model)
        self.index, self.seed, self.counting = index, seed, counting
        self.made: dict[str, torch.Tensor] = {}

    def all(self) -> dict:
        return {name: self.get(name) for name in self.specs}

    def get(self, name: str) -> torch.Tensor:
        if name not in self.made:
            shape, dtype = self.specs[name]
            self.made[name] = self.make(name, shape, dtype).to(dtype)
        return self.made[name]

    def gen(self, name: str) -> torch.Generator:
        return torch.Generator().manual_seed(
            (self.seed * 1_000_003 + self.index) * 65_537 + zlib.crc32(name.encode())
        )

    def randint(self, name: str, high: int, shape) -> torch.Tensor:
        return torch.randint(0, max(int(high), 1), tuple(shape), generator=self.gen(name))

    @property
    def seq(self) -> int:
        shape = self.specs.get("input_ids", ((1, 1), None))[0]
        return shape[-1] if len(shape) > 1 else 1

    def real(self) -> torch.Tensor:
        """(rows, seq) True on tokens, False on the padding that ends some rows."""
        rows = self.specs["input_ids"][0][0] if "input_ids" in self.specs else 1
        if "attention_mask" not in self.specs:  # nothing could tell padding from tokens
            return torch.ones(rows, self.seq, dtype=torch.bool)
        pads = torch.clamp(torch.arange(rows), max=self.seq // 8)
        return torch.arange(self.seq) < (self.seq - pads)[:, None]

    def documents(self, shape) -> torch.Tensor:
        """Positions of rows of 1 to 4 documents each, cut at up to 3 drawn points."""
        gen, seq = self.gen(POSITIONS), shape[-1]
        rows = []
        for _ in range(shape[0]):
            cuts = sorted(set(torch.randint(1, max(seq, 2), (3,), generator=gen).tolist()))
            bounds = [0, *(c for c in cuts if c < seq), seq]
            rows.append(positions([b - a for a, b in zip(bounds, bounds[1:])]))
        return torch.stack(rows)

    def make(self, name: str, shape, dtype) -> torch.Tensor:
        v = self.vocab
        if name == "input_ids":
            if self.counting and len(shape) == 2:
                start = self.randint(name, v.vocab_size, (shape[0], 1))
                return (start + torch.arange(shape[1])) % max(v.vocab_size, 1)
            return self.randint(name, v.vocab_size, shape)
        if name == "attention_mask":
            return self.real()
        if name == POSITIONS:
            return self.documents(shape)
        if name == "token_type_ids":  # a first and a second segment, as in sentence pairs
            return (torch.arange(shape[-1]) >= shape[-1] // 2).expand(shape).clone()
        if name == "decoder_input_ids" and "labels" in self.specs:
            return decoder_inputs(self.get("labels"), v, self.model_type)
        if self.head is not None and name in self.head.labels:
            return self.label(name, shape, dtype)
        if dtype.is_floating_point:
            return torch.randn(tuple(shape), generator=self.gen(name))
        if dtype == torch.bool:
            return self.randint(name, 2, shape).bool()
        return self.randint(name, v.vocab_size, shape)

    def label(self, name: str, shape, dtype) -> torch.Tensor:
        if dtype.is_floating_point:  # a regression head
            return torch.randn(tuple(shape), generator=self.gen(name))
        return LABELS[self.head.name](self, name, shape)


def _next_tokens(d: _Draw, name, shape):
    labels = d.get("input_ids").masked_fill(~d.real(), IGNORE)
    return starts_ignored(labels, d.get(POSITIONS)) if d.packed else labels


def _some_tokens(d: _Draw, name, shape):
    picked = torch.rand(tuple(shape), generator=d.gen(name)) < MASKED_LM_FRACTION
    picked[:, 0] = True  # every row predicts something: a loss over nothing is NaN
    return d.get("input_ids").masked_fill(~(picked & d.real()), IGNORE)


def _target(d: _Draw, name, shape):
    if d.counting:  # copy the source: the answer counts on from its first token
        return (d.get("input_ids")[:, :1] + torch.arange(shape[-1])) % max(d.vocab.vocab_size, 1)
    return d.randint(name, d.vocab.vocab_size, shape)


def _position(d: _Draw, name, shape):
    drawn = d.get("input_ids")[:, 0] if d.counting else d.randint(name, d.seq, shape)
    return drawn % d.real().sum(-1)  # inside the row's tokens


def _token_class(d: _Draw, name, shape):
    drawn = d.get("input_ids") if d.counting else d.randint(name, d.vocab.num_labels, shape)
    return (drawn % max(d.vocab.num_labels, 1)).masked_fill(~d.real(), IGNORE)


def _sequence_class(d: _Draw, name, shape):
    drawn = d.get("input_ids")[:, 0] if d.counting else d.randint(name, d.vocab.num_labels, shape)
    return drawn % max(d.vocab.num_labels, 1)


# head -> how its labels are drawn (see heads.HEADS for what each head is)
LABELS = {
    "causal-lm": _next_tokens,
    "seq2seq-lm": _target,
    "masked-lm": _some_tokens,
    "sequence-classification": _sequence_class,
    "question-answering": _position,
    "token-classification": _token_class,
}
