#!/usr/bin/env python
"""Build every configs/models/*.json on the meta device and check its parameter count.

Also sanity-checks configs/tasks/*.json and configs/hardware/*.json (keys, families,
default_task references). Exits 1 on any mismatch.

Usage: python tools/check_configs.py [--configs DIR] [NAME ...]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import transformers

ROOT = Path(__file__).resolve().parent.parent
MODEL_KEYS = {"name", "family", "hf_class", "description", "default_task", "parameters", "config"}
TASK_KEYS = {"name", "family", "description", "inputs", "micro_batch", "batch", "optimizer", "lr"}
HW_KEYS = {
    "name",
    "description",
    "memory_bytes",
    "peak_flops",
    "memory_bandwidth",
    "link_bandwidth",
    "efficiency",
    "kernel_overhead_s",
}
FAMILY_CLASSES = {
    "t5": {"T5ForConditionalGeneration"},
    "gpt2": {"GPT2LMHeadModel"},
    "bert": {"BertForQuestionAnswering"},
}


def build_config(cfg: dict) -> transformers.PretrainedConfig:
    cfg = dict(cfg)
    return transformers.AutoConfig.for_model(cfg.pop("model_type"), **cfg)


def count(model: torch.nn.Module) -> int:
    # model.parameters() yields shared (tied) tensors once
    return sum(p.numel() for p in model.parameters())


def build_count(hf_class: str, cfg: dict) -> int:
    with torch.device("meta"):
        return count(getattr(transformers, hf_class)(build_config(cfg)))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--configs", type=Path, default=ROOT / "configs")
    ap.add_argument("names", nargs="*", help="only these models (default: all)")
    args = ap.parse_args()
    transformers.logging.set_verbosity_error()

    errors: list[str] = []
    tasks = {}
    for p in sorted((args.configs / "tasks").glob("*.json")):
        t = json.loads(p.read_text())
        tasks[t.get("name")] = t
        if set(t) != TASK_KEYS:
            errors.append(f"task {p.name}: keys {sorted(set(t) ^ TASK_KEYS)} differ")
        if t.get("name") != p.stem:
            errors.append(f"task {p.name}: name {t.get('name')!r} != file stem")
        if t.get("family") not in FAMILY_CLASSES:
            errors.append(f"task {p.name}: unknown family {t.get('family')!r}")
        if t.get("batch", 0) % max(t.get("micro_batch", 1), 1):
            errors.append(f"task {p.name}: batch not a multiple of micro_batch")
    for p in sorted((args.configs / "hardware").glob("*.json")):
        h = json.loads(p.read_text())
        if set(h) != HW_KEYS:
            errors.append(f"hardware {p.name}: keys {sorted(set(h) ^ HW_KEYS)} differ")
        if h.get("name") != p.stem:
            errors.append(f"hardware {p.name}: name {h.get('name')!r} != file stem")

    print(f"{'model':<12} {'hf_class':<28} {'built':>15} {'expected':>15}  status")
    for p in sorted((args.configs / "models").glob("*.json")):
        m = json.loads(p.read_text())
        name = m.get("name")
        if args.names and name not in args.names:
            continue
        extra = set(m) - MODEL_KEYS - {"parameters_without_head"}
        if MODEL_KEYS - set(m) or extra:
            errors.append(f"model {p.name}: keys differ ({sorted((MODEL_KEYS - set(m)) | extra)})")
            continue
        if name != p.stem:
            errors.append(f"model {p.name}: name {name!r} != file stem")
        if m["hf_class"] not in FAMILY_CLASSES.get(m["family"], ()):
            errors.append(
                f"model {p.name}: hf_class {m['hf_class']} not valid for family {m['family']}"
            )
        if m["config"].get("model_type") != m["family"]:
            errors.append(f"model {p.name}: config.model_type != family")
        task = tasks.get(m["default_task"])
        if task is None or task["family"] != m["family"]:
            errors.append(
                f"model {p.name}: default_task {m['default_task']!r} missing or wrong family"
            )

        built = build_count(m["hf_class"], m["config"])
        ok = built == m["parameters"]
        print(
            f"{name:<12} {m['hf_class']:<28} {built:>15,} {m['parameters']:>15,}  {'OK' if ok else 'MISMATCH'}"
        )
        if not ok:
            errors.append(f"model {name}: built {built} != expected {m['parameters']}")
        if "parameters_without_head" in m:
            # headless backbone = the family's base model (for BERT: BertModel incl. pooler)
            base = {"t5": "T5Model", "gpt2": "GPT2Model", "bert": "BertModel"}[m["family"]]
            b = build_count(base, m["config"])
            okb = b == m["parameters_without_head"]
            print(
                f"{'':<12} {base + ' (no head)':<28} {b:>15,} {m['parameters_without_head']:>15,}  "
                f"{'OK' if okb else 'MISMATCH'}"
            )
            if not okb:
                errors.append(
                    f"model {name}: {base} built {b} != parameters_without_head "
                    f"{m['parameters_without_head']}"
                )

    for e in errors:
        print("ERROR:", e, file=sys.stderr)
    print(f"{'FAILED' if errors else 'all OK'} ({len(errors)} error(s))")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
