"""What a HuggingFace head takes and what its loss reads: the same rules for every family.

    head = get_head("causal-lm")
    names = input_names(head, forward_params, Vocab(vocab_size=32000))  # the forward's names
    shapes = input_shapes(head, names, seq_len=512)                      # per sample

The head decides the inputs and the labels, not the `model_type`: a Llama, a Qwen and a GPT-2
with a causal-LM head all take input ids, an attention mask and labels equal to the ids (the
model shifts them itself); every seq2seq LM takes source ids, a source mask, labels and the
labels shifted right as decoder inputs. A new family needs no entry anywhere unless it breaks
one of these rules; `FAMILY_RULES` holds the exceptions (mBART's decoder inputs).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields

from ..errors import unknown_name

IGNORE = -100  # label of a position the loss skips (padding): HuggingFace's ignore_index


@dataclass(frozen=True)
class Head:
    name: str
    mapping: str  # model_type -> class table of its AutoModelFor... (transformers.models.auto)
    labels: tuple[str, ...]  # what the loss reads besides the model's outputs
    label_length: str  # "seq": one per token, "target": one per decoder token, "sample": one
    decoder: bool = False  # encoder-decoder: decoder_input_ids are the labels shifted right
    default_task: str = ""  # the preset (configs/tasks) used when no --task is given
    description: str = ""

    @property
    def labels_are_input_ids(self) -> bool:
        """Causal LM: the label of a token is the token (the model shifts it by one)."""
        return self.name == "causal-lm"

    def loss_items(self, labels) -> int:
        """What the head's loss averages over in a batch whose `self.labels[0]` are `labels`:
        its label tokens that count (not IGNORE; a causal LM's from the second on, as the
        model shifts them: HuggingFace's `ForCausalLMLoss` and the Trainer's count), or its
        samples for a head with one label per sample (a classifier's loss is their mean)."""
        if self.label_length == "sample":
            return int(labels.shape[0])
        if self.labels_are_input_ids:
            labels = labels[..., 1:]
        return int((labels != IGNORE).sum())


HEADS = {
    h.name: h
    for h in (
        Head("causal-lm", "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES", ("labels",), "seq",
             default_task="wikitext2", description="next-token prediction; labels are the input ids"),
        Head("seq2seq-lm", "MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES", ("labels",), "target",
             decoder=True, default_task="rte",
             description="encoder-decoder; target tokens as labels, decoder inputs their shift"),
        Head("masked-lm", "MODEL_FOR_MASKED_LM_MAPPING_NAMES", ("labels",), "seq",
             default_task="mlm", description="predict some tokens from both sides"),
        Head("sequence-classification", "MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES",
             ("labels",), "sample", default_task="sst2", description="one class per sequence"),
        Head("question-answering", "MODEL_FOR_QUESTION_ANSWERING_MAPPING_NAMES",
             ("start_positions", "end_positions"), "sample", default_task="squad",
             description="extractive: answer start and end"),
        Head("token-classification", "MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING_NAMES", ("labels",),
             "seq", default_task="conll2003", description="one class per token"),
    )
}  # fmt: skip

# model_type -> where a family breaks the head rules above: the one place for such exceptions.
FAMILY_RULES: dict[str, dict] = {
    # The decoder starts with the target's last token (the language id), not with a fixed
    # decoder_start_token_id (their `shift_tokens_right`).
    "mbart": {"shift": "wrap-last"},
    "plbart": {"shift": "wrap-last"},
}


def family_rule(model_type: str, key: str, default: str) -> str:
    return FAMILY_RULES.get(model_type, {}).get(key, default)


def get_head(name: str) -> Head:
    try:
        return HEADS[name]
    except KeyError:
        raise ValueError(unknown_name("head", name, HEADS)) from None


@dataclass(frozen=True)
class Vocab:
    """The model's figures that synthetic inputs need, read from its config."""

    vocab_size: int = 2
    type_vocab_size: int = 0  # token types (BERT's segments); below 2 none are fed
    num_labels: int = 2
    pad_token_id: int = 0
    decoder_start_token_id: int = 0

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, d: dict | None) -> Vocab:
        d = d or {}
        return cls(**{f.name: int(d[f.name]) for f in fields(cls) if d.get(f.name) is not None})


def input_names(
    head: Head, forward_params, vocab: Vocab, *, packed: bool = False
) -> tuple[str, ...]:
    """The inputs to feed, in the order of the forward's own parameters. `packed` (a causal LM
    compiled with --pack): position ids instead of the 2-D attention mask, from which the model
    derives a mask that keeps packed documents apart (`packing.py`)."""
    wanted = {"input_ids", "position_ids" if packed else "attention_mask", *head.labels}
    if head.decoder:
        wanted.add("decoder_input_ids")
    if vocab.type_vocab_size >= 2:  # GPT-2 takes token_type_ids too, but has no types
        wanted.add("token_type_ids")
    names = tuple(p for p in forward_params if p in wanted)
    missing = [n for n in ("input_ids", *head.labels) if n not in names]
    if missing:
        raise ValueError(f"its forward takes no {', '.join(missing)}, which a {head.name} needs")
    if packed and "position_ids" not in names:
        raise ValueError("its forward takes no position_ids, which --pack needs")
    return names


def problem_type(head: Head, vocab: Vocab) -> str | None:
    """What a sequence classifier's labels make of it (transformers' `config.problem_type`):
    one class regresses a float label (MSE), more pick one class of an int label (cross-entropy).
    Set in the config, it spares the forward guessing from the labels (DeBERTa-v2 looks at
    their values, which no trace can follow)."""
    if head.name != "sequence-classification":
        return None
    return "regression" if vocab.num_labels == 1 else "single_label_classification"


def input_shapes(
    head: Head, names, seq_len: int, target_len: int = 0, vocab: Vocab | None = None
) -> dict[str, tuple[list[int], str]]:
    """name -> (per-sample shape, dtype) of each input."""
    per = {"seq": [seq_len], "target": [target_len], "sample": []}
    float_labels = vocab is not None and problem_type(head, vocab) == "regression"
    out = {}
    for n in names:
        if n in head.labels:
            out[n] = (per[head.label_length], "float32" if float_labels else "int64")
        elif n == "decoder_input_ids":
            out[n] = ([target_len], "int64")
        else:
            out[n] = ([seq_len], "int64")
    return out


def with_dropout(config: dict, p: float) -> dict:
    """The config with every dropout probability set to `p` (0.0: dropout off)."""
    out = dict(config)
    for key, value in config.items():
        named = "dropout" in key or key.endswith(("_pdrop", "_prob"))
        if named and isinstance(value, float):
            out[key] = p
    return out
