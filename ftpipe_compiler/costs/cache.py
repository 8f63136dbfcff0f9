"""The cache of measured profiles: the key of what a timing depends on, and its results.

    key = profile_key(spec, graph, granularity="layer", device="cpu (x86_64, 2 threads)", ...)
    graph = load_profile(key, graph)      # None on a miss
    save_profile(key, costed)

Cache files live in `~/.cache/ftpipe/profiles/` unless `FTPIPE_CACHE_DIR` or `cache_dir` says
otherwise, one costed-graph JSON per key. The key hashes everything a timing depends on:
the model spec and its config, the traced graph (ids, ops, shapes), input shapes,
micro-batch, granularity, device, torch version, repeats and seed.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import torch
from ftpipe_runtime.errors import WriteFailed
from ftpipe_runtime.job.cpu_allocator import VARIABLE

from ..errors import PlanFormatError
from ..graph.opgraph import OpGraph

CACHE_FORMAT = 5  # 2: weight-gradient times (wgrad_s) measured; 3: huge pages on CPU;
# 4: the LM head and its loss fused (graph.fuse); 5: glibc heap kept (cpu_allocator)


def profile_dir(cache_dir=None) -> Path:
    if cache_dir is not None:
        return Path(cache_dir)
    env = os.environ.get("FTPIPE_CACHE_DIR")
    return Path(env) if env else Path.home() / ".cache" / "ftpipe" / "profiles"


def profile_key(spec, graph: OpGraph, **settings) -> str:
    """A hex digest of what the measured times depend on; `settings` are the profiler's options."""
    shape = hashlib.sha256()
    for n in graph.nodes:
        shape.update(f"{n.id}|{n.op}|{n.shape}|{n.dtype}|{','.join(n.members)}\n".encode())
    fields = {
        "format": CACHE_FORMAT,
        "model": spec.spec,
        "kind": spec.kind,
        "hf_class": spec.hf_class,
        "config": spec.config,
        "freeze": spec.freeze,  # frozen weights change the backward measured
        "lora": spec.lora,
        "inputs": [[i.name, list(i.shape), i.dtype] for i in graph.inputs],
        "micro_batch": graph.meta.get("micro_batch"),
        "graph": shape.hexdigest(),
        "torch": torch.__version__,
        "huge_pages": os.environ.get(VARIABLE),  # changes the time of large CPU tensors
        "malloc": {k: v for k, v in os.environ.items() if k.startswith(("MALLOC_", "GLIBC_"))},
        **settings,
    }
    text = json.dumps(fields, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def load_profile(key: str, graph: OpGraph, cache_dir=None) -> OpGraph | None:
    """The cached costed graph for `key`, or None when absent, damaged or of another graph."""
    path = profile_dir(cache_dir) / f"{key}.json"
    if not path.is_file():
        return None
    try:
        cached = OpGraph.load(path)
    except (PlanFormatError, KeyError, TypeError):
        return None  # a damaged entry is a miss; the fresh profile overwrites it
    if [n.id for n in cached.nodes] != [n.id for n in graph.nodes]:
        return None
    return cached


def save_profile(key: str, graph: OpGraph, cache_dir=None) -> Path:
    """Written atomically (`OpGraph.save`): a profile killed half-way leaves no truncated entry."""
    folder = profile_dir(cache_dir)
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise WriteFailed(f"cannot create the profile cache {folder}: {e.strerror}") from None
    path = folder / f"{key}.json"
    graph.save(path)
    return path
