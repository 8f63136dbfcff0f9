r"""The one way a value from outside (the command line, a model's folder, module or parameter
name, a path) reaches the generated Python: escaped here, so that no name can end a comment
or a docstring, or run as code, when the package is imported.

    literal('o\nimport os')     # "o\nimport os" (a backslash and an n): one line, evaluates back
    text("\"\"\"\nimport os")    # \"\"\"\nimport os: one line, inert in a comment or docstring
    identifier("3b model")      # v3b_model: ASCII letters, digits and underscores only

Both escapes leave printable characters as they are and write backslashes, double quotes
and everything else (newlines, carriage returns, the other characters `str.splitlines`
breaks at, NUL, lone surrogates) as Python escapes. Python's tokenizer ends a comment only
at \n or \r, but a form feed or \u2028 would still split a line for other tools, and NUL
makes the file no Python at all. The package templates are rendered with `finalize`, so a
value they print without `| py` goes through `text`: escaping is the default, and only what
this module returns (`Source`: code the emitter wrote, or an escaped value) is placed as it
is.
"""

from __future__ import annotations

import math
import re
import unicodedata

__all__ = ["Source", "finalize", "identifier", "literal", "text"]


class Source(str):
    """Text fit to stand in generated source as it is: code written by the compiler, or a
    value escaped by `literal` or `text`."""


def _escape(s: str) -> str:
    r"""`s` with backslashes, double quotes and every non-printable character escaped
    (`\n`, `\x0b`, `\u2028`...): what may sit between double quotes, and on one line."""
    return "".join("\\" + c if c in '\\"' else c if c.isprintable() else repr(c)[1:-1] for c in s)


def literal(value) -> Source:
    """`value` as a Python literal: a string in double quotes (`eval` gives it back), a
    number, a bool, None, or a tuple or list of them."""
    if isinstance(value, str):
        return Source(f'"{_escape(value)}"')
    if isinstance(value, float) and not math.isfinite(value):
        return Source(f'float("{value}")')
    if value is None or isinstance(value, (bool, int, float)):
        return Source(repr(value))
    if isinstance(value, (tuple, list)):
        inner = ", ".join(literal(v) for v in value)
        if isinstance(value, list):
            return Source(f"[{inner}]")
        return Source(f"({inner},)" if len(value) == 1 else f"({inner})")
    raise TypeError(f"no Python literal for a {type(value).__name__}")


def text(value) -> Source:
    """`value` (anything printable) as one line safe inside a comment or a docstring."""
    return Source(_escape(str(value)))


def identifier(name: str, *, default: str = "value", lead: str = "v") -> str:
    """An ASCII Python identifier made of `name`: accents dropped, every other character
    that is no letter, digit or underscore an underscore, `lead` before a leading digit."""
    plain = "".join(c for c in unicodedata.normalize("NFKD", name) if not unicodedata.combining(c))
    word = re.sub(r"[^0-9A-Za-z_]+", "_", plain).strip("_") or default
    return lead + word if word[0].isdigit() else word


def finalize(value):
    """Jinja's `finalize` for templates that write Python: numbers and `Source` as they
    are, anything else as `text`."""
    if isinstance(value, (Source, int, float)):
        return value
    return text(value)
