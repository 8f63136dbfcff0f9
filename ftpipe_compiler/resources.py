"""Find the shipped configs and templates, installed (`pip install .`) or in a checkout."""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path

_REPO = Path(__file__).resolve().parent.parent


def _root(package: str, folder: str) -> Path:
    try:
        root = Path(str(resources.files(package)))
        if root.is_dir():
            return root
    except (ModuleNotFoundError, TypeError):
        pass
    return _REPO / folder


def configs_dir() -> Path:
    return _root("ftpipe_compiler._configs", "configs")


def templates_dir() -> Path:
    return _root("ftpipe_compiler._templates", "templates")


def config_names(kind: str) -> list[str]:
    """`config_names("hardware")` -> ["a100-80gb", "cpu", ...]"""
    return sorted(p.stem for p in (configs_dir() / kind).glob("*.json"))


def load_config(kind: str, name: str) -> dict | None:
    """A shipped config by its name (None: no such name; a path is no name)."""
    path = configs_dir() / kind / f"{name}.json"
    if Path(name).name != name or name.startswith(".") or not path.is_file():
        return None
    return json.loads(path.read_text())
