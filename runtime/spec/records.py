"""Frozen dataclasses to and from JSON objects, every field checked against its annotation.

    stage = from_json(Stage, {"id": 0, "gpu": 1, ...})   # TypeError naming a field that does not fit
    to_json(stage)                                        # {"id": 0, "gpu": 1, ...}: lists for tuples

A hand-edited file then fails where it is read, in one sentence naming the field, not deep
inside whatever reads the field first. A field annotated with another record (or a tuple
of them) is built from its own annotation, or by the record's own `from_dict`/`from_json`
when it has one (a cluster, which looks its hardware up by name); written back the same way.
The compiler's graph and plan files and the runtime's plan are all read through here.
"""

from __future__ import annotations

import dataclasses
import functools
import types
import typing

__all__ = ["from_json", "to_json"]


def from_json(cls, d):
    """`cls` built from the JSON object `d`: lists back into tuples, nested records built,
    keys `cls` does not know ignored (a newer writer's extra fields, derived figures)."""
    if not isinstance(d, dict):
        raise TypeError(f"a {cls.__name__} must be a JSON object, not {type(d).__name__}")
    hints = _hints(cls)
    values = {k: _value(v, hints[k]) for k, v in d.items() if k in hints}
    for k, v in values.items():
        if not _conforms(v, hints[k]):
            raise TypeError(f"{cls.__name__} field {k!r} cannot be {v!r:.60}")
    return cls(**values)


def to_json(record) -> dict:
    """A record as a JSON object, its fields in declaration order."""
    return {f.name: _plain(getattr(record, f.name)) for f in dataclasses.fields(record)}


def _value(v, hint):
    """A JSON value as the annotation `hint` holds it (records built, lists as tuples)."""
    if isinstance(v, dict):
        made = _record_class(hint)
        return _build(made, v) if made is not None else v
    if isinstance(v, list):
        origin, args = typing.get_origin(hint), typing.get_args(hint)
        inner = args[0] if origin is tuple and len(args) == 2 and args[1] is Ellipsis else None
        made = _record_class(inner) if inner is not None else None
        if made is not None:
            return tuple(_build(made, x) for x in v)
        return _to_tuple(v)
    return v


def _record_class(hint):
    """The record class `hint` names (alone or as `X | None`), else None."""
    if dataclasses.is_dataclass(hint):
        return hint
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        found = [a for a in typing.get_args(hint) if dataclasses.is_dataclass(a)]
        return found[0] if len(found) == 1 else None
    return None


def _build(cls, d):
    for name in ("from_dict", "from_json"):
        own = getattr(cls, name, None)
        if own is not None:
            return own(d)
    return from_json(cls, d)


def _plain(v):
    if dataclasses.is_dataclass(v) and not isinstance(v, type):
        for name in ("to_dict", "to_json"):
            own = getattr(v, name, None)
            if own is not None:
                return own()
        return to_json(v)
    if isinstance(v, (tuple, list)):
        return [_plain(x) for x in v]
    if isinstance(v, dict):
        return {k: _plain(x) for k, x in v.items()}
    return v


@functools.cache
def _hints(cls) -> dict:
    return typing.get_type_hints(cls)


def _conforms(v, hint) -> bool:
    if hint is float:
        return isinstance(v, (int, float)) and not isinstance(v, bool)
    if hint is int:
        return isinstance(v, int) and not isinstance(v, bool)
    if hint in (str, bool, dict):
        return isinstance(v, hint)
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is tuple:
        if len(args) == 2 and args[1] is Ellipsis:
            return isinstance(v, tuple) and all(_conforms(x, args[0]) for x in v)
        return isinstance(v, tuple) and len(v) == len(args)
    if origin in (typing.Union, types.UnionType):
        return any(_conforms(v, a) for a in args)
    if origin is dict:
        return isinstance(v, dict)
    if dataclasses.is_dataclass(hint):
        return isinstance(v, hint)
    return True  # not checked: the readers of such a field validate it


def _to_tuple(v):
    return tuple(_to_tuple(x) for x in v) if isinstance(v, list) else v
