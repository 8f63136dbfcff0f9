#!/usr/bin/env python
"""Build every configs/models/*.json on the meta device and check its parameter count.

Also sanity-checks configs/tasks/*.json and configs/hardware/*.json (keys, heads, default_task
references, sources). The head of a model comes from its config's `architectures`, as
`ftpipe compile` finds it (`ftpipe_runtime.models`): this tool keeps no table of families.
Exits 1 on any mismatch.

Usage: python tools/check_configs.py [--configs DIR] [NAME ...]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from ftpipe_runtime.models import HEADS
from ftpipe_runtime.models.hf import head_of_class, hf_config

from ftpipe_compiler.costs.hardware import Hardware

ROOT = Path(__file__).resolve().parent.parent
MODEL_KEYS = {"name", "description", "default_task", "parameters", "config"}
MODEL_OPTIONAL = {"hub_id", "parameters_without_head"}
TASK_KEYS = {"name", "head", "description", "seq_len", "micro_batch", "batch", "optimizer", "lr"}
HW_KEYS = {
    "name",
    "description",
    "memory_bytes",
    "peak_flops",
    "peak_flops_16bit",
    "memory_bandwidth",
    "link_bandwidth",
    "efficiency",
    "kernel_overhead_s",
    "node",
    "sources",
}
# Measured per machine (python -m benchmarks.calibrate), or only where a GPU has it (TF32).
HW_OPTIONAL = {
    "peak_flops_tf32",
    "link_latency_s",
    "optimizer_bandwidth",
    "optimizer_cache_bandwidth",
    "cache_bytes",
    "calibration",
}
NODE_KEYS = {"gpus", "intra_node", "inter_node", "sources"}


def count(model: torch.nn.Module) -> int:
    # model.parameters() yields shared (tied) tensors once
    return sum(p.numel() for p in model.parameters())


def build_count(auto_or_class: str, cfg: dict) -> int:
    """Parameters of `auto_or_class` (a transformers class or Auto class) built on meta."""
    import transformers

    config = hf_config(cfg)
    cls = getattr(transformers, auto_or_class)
    with torch.device("meta"):
        model = cls.from_config(config) if auto_or_class.startswith("Auto") else cls(config)
    return count(model)


def check_tasks(folder: Path, errors: list[str]) -> dict:
    tasks = {}
    for p in sorted(folder.glob("*.json")):
        t = json.loads(p.read_text())
        tasks[t.get("name")] = t
        keys = TASK_KEYS | ({"target_len"} if t.get("head") == "seq2seq-lm" else set())
        if set(t) != keys:
            errors.append(f"task {p.name}: keys {sorted(set(t) ^ keys)} differ")
        if t.get("name") != p.stem:
            errors.append(f"task {p.name}: name {t.get('name')!r} != file stem")
        if t.get("head") not in HEADS:
            errors.append(f"task {p.name}: unknown head {t.get('head')!r}")
        if t.get("batch", 0) % max(t.get("micro_batch", 1), 1):
            errors.append(f"task {p.name}: batch not a multiple of micro_batch")
    for head in HEADS.values():
        if head.default_task not in tasks:
            errors.append(f"head {head.name}: default task {head.default_task!r} missing")
    return tasks


def check_hardware(folder: Path, errors: list[str]) -> None:
    for p in sorted(folder.glob("*.json")):
        h = json.loads(p.read_text())
        # Every required key; beyond them only what `Hardware` reads (measured figures, the
        # memory reserve), so a misspelt key is caught.
        odd = (HW_KEYS - set(h)) | (set(h) - HW_KEYS - set(Hardware.__dataclass_fields__))
        if odd:
            errors.append(f"hardware {p.name}: keys {sorted(odd)} differ")
        if h.get("peak_flops_tf32", h.get("peak_flops", 0)) < h.get("peak_flops", 0):
            errors.append(f"hardware {p.name}: peak_flops_tf32 below the plain fp32 peak_flops")
        if h.get("name") != p.stem:
            errors.append(f"hardware {p.name}: name {h.get('name')!r} != file stem")
        if not h.get("sources"):
            errors.append(f"hardware {p.name}: no sources for its figures")
        if set(h.get("peak_flops_16bit") or {}) != {"bfloat16", "float16"}:
            errors.append(f"hardware {p.name}: peak_flops_16bit needs bfloat16 and float16")
        node = h.get("node") or {}
        if set(node) != NODE_KEYS or not node.get("sources"):
            errors.append(f"hardware {p.name}: node keys {sorted(set(node) ^ NODE_KEYS)} differ")
        elif not node["inter_node"].get("bandwidth", 0) > 0:
            errors.append(f"hardware {p.name}: the node's network needs a bandwidth")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--configs", type=Path, default=ROOT / "configs")
    ap.add_argument("names", nargs="*", help="only these models (default: all)")
    args = ap.parse_args()

    errors: list[str] = []
    tasks = check_tasks(args.configs / "tasks", errors)
    check_hardware(args.configs / "hardware", errors)

    print(f"{'model':<14} {'class':<30} {'built':>15} {'expected':>15}  status")
    for p in sorted((args.configs / "models").glob("*.json")):
        m = json.loads(p.read_text())
        name = m.get("name")
        if args.names and name not in args.names:
            continue
        extra = set(m) - MODEL_KEYS - MODEL_OPTIONAL
        if MODEL_KEYS - set(m) or extra:
            errors.append(f"model {p.name}: keys differ ({sorted((MODEL_KEYS - set(m)) | extra)})")
            continue
        if name != p.stem:
            errors.append(f"model {p.name}: name {name!r} != file stem")
        cls = (m["config"].get("architectures") or [""])[0]
        head = head_of_class(cls)
        if head is None:
            errors.append(f"model {p.name}: architectures {cls!r} is none of the heads")
            continue
        task = tasks.get(m["default_task"])
        if task is None or task["head"] != head:
            errors.append(
                f"model {p.name}: default_task {m['default_task']!r} missing or not {head}"
            )

        built = build_count(cls, m["config"])
        ok = built == m["parameters"]
        status = "OK" if ok else "MISMATCH"
        print(f"{name:<14} {cls:<30} {built:>15,} {m['parameters']:>15,}  {status}")
        if not ok:
            errors.append(f"model {name}: built {built} != expected {m['parameters']}")
        if "parameters_without_head" in m:
            # the headless backbone: what AutoModel builds for the config (BERT: with pooler)
            b = build_count("AutoModel", m["config"])
            okb = b == m["parameters_without_head"]
            print(
                f"{'':<14} {'AutoModel (no head)':<30} {b:>15,} "
                f"{m['parameters_without_head']:>15,}  {'OK' if okb else 'MISMATCH'}"
            )
            if not okb:
                errors.append(
                    f"model {name}: AutoModel built {b} != parameters_without_head "
                    f"{m['parameters_without_head']}"
                )

    for e in errors:
        print("ERROR:", e, file=sys.stderr)
    print(f"{'FAILED' if errors else 'all OK'} ({len(errors)} error(s))")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
