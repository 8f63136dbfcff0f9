"""Chat data: each sample a list of {role, content} messages, rendered with a chat template,
the loss on the assistant turns only.

    template = chat_template(tokenizer, "template.jinja" or None)   # the text, or one sentence
    columns = chat_columns(tokenizer, conversations, template, where=lambda i: f"line {i + 1}")
    # {"input_ids": [[...], ...], "labels": [[-100, ..., 17, 4, -100, ...], ...]}

The conversation is rendered once and tokenized once (a fast tokenizer, with character
offsets), so the input ids are exactly `tokenizer.apply_chat_template(messages)`'s: what the
model sees of a history at inference. Which characters belong to an assistant turn comes from
rendering prefixes: for assistant message i, `messages[:i]` with the generation prompt ends
where the reply starts, `messages[:i + 1]` ends where the turn ends. A token is a label when its
first character lies in such a span; every other token is -100. The span starts at the reply's
content (so a template that has no generation prompt does not teach its role header) and ends
with the turn (less trailing whitespace), so the end-of-turn marker the template writes after
the content (`<|im_end|>`, `<|eot_id|>`, `</s>`) is learnt too: without it the model would never
learn to stop.

Why prefixes and not `return_assistant_tokens_mask`: that needs `{% generation %}` blocks in
the template, which few shipped templates have; prefixes work with any template that renders
a conversation's beginning the same whether or not more messages follow, and one that does
not (a template that rewrites earlier turns) is refused with a sentence naming the sample.
"""

from __future__ import annotations

from functools import partial
from pathlib import Path

from ..errors import PipelineConfigError
from ..models import IGNORE

__all__ = ["ROLES", "chat_columns", "chat_template", "template_name"]

ROLES = ("system", "developer", "user", "assistant", "tool")


def chat_template(tokenizer, file=None) -> str:
    """The Jinja chat template: the text of `file` (`--chat-template`), else the tokenizer's."""
    if file:
        try:
            return Path(file).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise PipelineConfigError(
                f"cannot read the chat template {file} ({type(e).__name__}); give a Jinja "
                "template file with --chat-template"
            ) from None
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):  # several named templates: the default one
        template = template.get("default")
    if not template:
        raise PipelineConfigError(
            "the tokenizer has no chat template to render --chat-field with; pass "
            "--chat-template FILE (a Jinja template)"
        )
    return template


def template_name(file=None) -> str:
    """The template as sentences name it: `--chat-template FILE`'s, else the tokenizer's."""
    return f"the chat template {file}" if file else "the tokenizer's chat template"


def chat_columns(tokenizer, conversations: list, template: str, where, template_file=None) -> dict:
    """Input ids and labels (assistant turns only) of each conversation; `where(i)` names
    sample i in errors ("train.jsonl line 3"), `template_file` the template (None: the
    tokenizer's)."""
    if not getattr(tokenizer, "is_fast", False):
        raise PipelineConfigError(
            "chat data needs a fast tokenizer (character offsets find the assistant turns); "
            "give a folder with tokenizer.json via --tokenizer"
        )
    ids, labels = [], []
    for i, messages in enumerate(conversations):
        sample = partial(where, i)  # its name, found only for an error
        messages = _check(messages, sample)
        text, spans = _render(tokenizer, messages, template, sample, template_file)
        encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        row = encoded["input_ids"]
        starts = [start for start, _ in encoded["offset_mapping"]]
        ids.append(row)
        labels.append(
            [t if any(a <= s < b for a, b in spans) else IGNORE for t, s in zip(row, starts)]
        )
    return {"input_ids": ids, "labels": labels}


def _check(messages, where) -> list[dict]:
    """A list of {role, content} with known roles and text content, or one sentence."""
    if isinstance(messages, list) and not messages:
        raise PipelineConfigError(
            f"{where()}: the chat field holds no messages (an empty list); give a list of "
            "{role, content} messages, or leave the sample out"
        )
    if not isinstance(messages, list):
        raise PipelineConfigError(
            f"{where()}: the chat field holds {type(messages).__name__}, not a list of "
            "{role, content} messages"
        )
    out = []
    for n, m in enumerate(messages, 1):
        if not isinstance(m, dict) or "role" not in m:
            raise PipelineConfigError(
                f"{where()}: message {n} is not an object with a role and a content"
            )
        m = {k: v for k, v in m.items() if v is not None}  # fields other rows have (arrow)
        if m.get("role") not in ROLES:
            raise PipelineConfigError(
                f"{where()}: message {n} has the unknown role {m.get('role')!r}; roles are "
                f"{', '.join(ROLES)}"
            )
        if not isinstance(m.get("content"), str):
            raise PipelineConfigError(f"{where()}: message {n} ({m['role']}) has no text content")
        out.append(m)
    return out


def _render(tokenizer, messages: list[dict], template: str, where, template_file=None) -> tuple:
    """The conversation's text and the character spans of its assistant turns."""

    def render(part, prompt=False) -> str:
        try:
            return tokenizer.apply_chat_template(
                part, chat_template=template, tokenize=False, add_generation_prompt=prompt
            )
        except Exception as e:  # noqa: BLE001 - jinja raises many types, one meaning
            if _syntax_error(e):  # the template's fault, whatever the sample
                raise PipelineConfigError(
                    f"{template_name(template_file)} has a syntax error on its line {e.lineno} ({e.message}); fix it, "
                    "or pass another with --chat-template FILE"
                ) from None
            raise PipelineConfigError(
                f"{where()}: the chat template fails on it ({type(e).__name__}: {e})"
            ) from None

    text, spans = render(messages), []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        before, upto = render(messages[:i], prompt=True), render(messages[: i + 1])
        if not (upto.startswith(before) and text.startswith(upto)):
            raise PipelineConfigError(
                f"{where()}: the chat template renders the conversation's start differently "
                f"once message {i + 1} follows, so its assistant turns cannot be found; give a "
                "template that only appends (--chat-template FILE)"
            )
        content = m["content"].strip()
        at = upto.find(content, len(before)) if content else -1
        # to the turn's end, less the whitespace that separates it from the next message
        spans.append((at if at >= 0 else len(before), len(upto.rstrip())))
    return text, spans


def _syntax_error(e: Exception) -> bool:
    try:
        from jinja2 import TemplateSyntaxError
    except ImportError:  # (transformers renders with jinja2: without it nothing was rendered)
        return False
    return isinstance(e, TemplateSyntaxError)
