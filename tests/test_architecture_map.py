"""docs/architecture.md maps every module of both packages: each folder of the compiler and
the runtime has a paragraph headed **`<folder>/`**, which names each of its modules
(`name.py`)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = {"ftpipe_compiler": ROOT / "ftpipe_compiler", "runtime": ROOT / "runtime"}


def _paragraphs() -> dict[str, str]:
    """Folder heading -> the text up to the next heading."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    heads = list(re.finditer(r"^\*\*`([\w/]+/)`\*\*", text, flags=re.M))
    ends = [h.start() for h in heads[1:]] + [len(text)]
    return {h.group(1): text[h.end() : end] for h, end in zip(heads, ends, strict=True)}


def test_every_module_is_on_the_map():
    paragraphs = _paragraphs()
    missing = []
    for top, folder in FOLDERS.items():
        for path in sorted(folder.rglob("*.py")):
            if "__pycache__" in path.parts or path.name in ("__init__.py", "__main__.py"):
                continue
            head = "/".join([top, *path.parent.relative_to(folder).parts]) + "/"
            if f"`{path.name}`" not in paragraphs.get(head, "") and not re.search(
                rf"`{re.escape(path.stem)}\.py`", paragraphs.get(head, "")
            ):
                missing.append(f"{head}{path.name}")
    assert missing == [], "modules docs/architecture.md does not name under their folder"


def test_every_folder_has_a_purpose():
    paragraphs = _paragraphs()
    for top, folder in FOLDERS.items():
        for init in folder.rglob("__init__.py"):
            head = "/".join([top, *init.parent.relative_to(folder).parts]) + "/"
            assert len(paragraphs.get(head, "").split()) >= 8, f"{head} has no paragraph"
