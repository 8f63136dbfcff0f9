"""Hub ids (`meta-llama/Llama-3.1-8B`) resolved through the local HuggingFace cache only.

    folder = cached_folder("meta-llama/Llama-3.1-8B")   # the snapshot folder, or None

Nothing is downloaded, ever: a model that is not in the cache is an error that says how to
get its folder.
"""

from __future__ import annotations

import re
from pathlib import Path

HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")


def looks_like_hub_id(spec: str) -> bool:
    return bool(HUB_ID.fullmatch(spec))


def cache_dir() -> Path:
    from huggingface_hub import constants

    return Path(constants.HF_HUB_CACHE)


def cached_folder(repo_id: str) -> Path | None:
    """The cached snapshot holding the model's config.json, or None (no download is tried)."""
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:
        return None
    found = try_to_load_from_cache(repo_id, "config.json", cache_dir=str(cache_dir()))
    return Path(found).parent if isinstance(found, str) else None


def not_cached(repo_id: str) -> str:
    """What to say when `repo_id` is neither a folder nor in the cache."""
    local = repo_id.split("/")[-1]
    return (
        f"{repo_id} is not a folder here and not in the local HuggingFace cache "
        f"({cache_dir()}); ftpipe downloads nothing: get it with `hf download "
        f"{repo_id} --local-dir {local}` and pass --model {local}, or pick a shipped model "
        "(ftpipe models)"
    )
