"""A timed part's set-up (analytic compiles, a model or weights written) moved out of it, into a
compute-only part of the same section: `benchmarks.sections` runs those first, two at a time,
so the set-up no longer holds the machine that the timed parts need alone.

    PARTS = {"set-up": (partial(prepare, WORK, make), False), "": (timed, True)}
    made = take(WORK, make)   # in `timed`: what the set-up part made, else made there and then

`make(work) -> dict` (JSON: paths as strings) must not time anything: it runs beside another
compute-only part.
"""

from __future__ import annotations

import json
from pathlib import Path

from ftpipe_runtime.atomic import write_atomic

NOTE = "set-up.json"  # in the section's folder: what `make` returned, until the timed part reads it


def prepare(work: Path, make) -> dict:
    """The set-up part: `make(work)`, noted for the timed part."""
    work.mkdir(parents=True, exist_ok=True)
    made = make(work)
    write_atomic(work / NOTE, json.dumps(made))
    return made


def take(work: Path, make) -> dict:
    """What `prepare` made this run (its note is used up, so a later run alone never finds a
    stale one), else `make(work)` now."""
    note = work / NOTE
    try:
        made = json.loads(note.read_text())
    except FileNotFoundError:
        work.mkdir(parents=True, exist_ok=True)
        return make(work)
    note.unlink()
    return made


def timed_only(parts: dict) -> dict:
    """A section's data: its timed part's result (the set-up's is only a note)."""
    return parts[""]
