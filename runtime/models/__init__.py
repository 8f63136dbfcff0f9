"""The one place that knows model families, generically, from the HuggingFace head.

`heads`: which inputs each head takes and what its loss reads (causal LM, seq2seq LM, masked
LM, sequence classification, question answering, token classification). `synthetic`: inputs
of any micro-batch, the same for the compiler, a package's `--check` and the runtime. `hf`:
the transformers side (classes, configs, forward signatures, the loss), imported lazily.
The compiler, generated packages and the runtime all use these; none keeps its own table.
"""

from .heads import (
    FAMILY_RULES,
    HEADS,
    IGNORE,
    Head,
    Vocab,
    family_rule,
    get_head,
    input_names,
    input_shapes,
    with_dropout,
)

_SYNTHETIC = ("LABELS", "SHIFTS", "decoder_inputs", "shift_right", "synthetic_batch")


def __getattr__(name: str):
    # `synthetic` needs torch; `heads` does not, and `ftpipe models` reads only it.
    if name in _SYNTHETIC:
        from . import synthetic

        return getattr(synthetic, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "FAMILY_RULES",
    "HEADS",
    "IGNORE",
    "LABELS",
    "SHIFTS",
    "Head",
    "Vocab",
    "decoder_inputs",
    "family_rule",
    "get_head",
    "input_names",
    "input_shapes",
    "shift_right",
    "synthetic_batch",
    "with_dropout",
]
