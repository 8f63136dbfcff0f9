"""The fine-tuned model as a HuggingFace folder: what `from_pretrained` loads.

    write_hf_folder("out", plan, tensors, tokenizer="path/to/model")   # tensors: name -> tensor
    tensors = gather_tensors(plan, mine, rank, ranks, device)           # every rank's, on rank 0
    export_checkpoint(plan, "checkpoints/t5", step=None, out="out")     # from a checkpoint

    python -m <package> export --checkpoint-dir D [--step N] -o DIR      # the command (`main`)

The stages' tensors go back under the model's own names into the model, built on `meta` from
the plan's config, and the model's own `save_pretrained` writes the folder: config.json,
safetensors shards and their index (one file when it fits in `max_shard_size`), a tied weight
once (transformers drops its aliases), the checkpoint names transformers expects. The
tokenizer files of the model's folder (or `--tokenizer`) are copied beside them. The folder is
built next to its destination and swapped in whole (`ftpipe_runtime.atomic.new_folder`).
Needs transformers and safetensors (`ftpipe[hf]`).
"""

from __future__ import annotations

import argparse
import fnmatch
import re
import shutil
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from ..atomic import new_folder
from ..errors import PeerFailure, PipelineConfigError, WriteFailed
from ..job import liveness
from ..spec.plan import read_plan
from ..spec.weights import initial_value
from .store import Checkpoints, default_dir, plan_hash, read_tensors, step_dir

if TYPE_CHECKING:
    from ..job.config import ExportConfig

__all__ = ["check_replaceable", "export_checkpoint", "gather_tensors", "main", "write_hf_folder"]

MAX_SHARD = "5GB"
MERGE_HELP = "LoRA: also write the model with the adapters merged in, as <folder>/merged"
TOKENIZER_FILES = ("tokenizer*", "special_tokens_map.json", "added_tokens.json", "vocab.*",
                   "merges.txt", "*.model", "*.tiktoken", "chat_template.*")  # fmt: skip


def check_exportable(plan: dict) -> None:
    """Refuse early what cannot become a HuggingFace folder."""
    model = plan.get("model", {})
    if not model.get("hf_class") or not isinstance(model.get("config"), dict):
        raise PipelineConfigError(
            "a HuggingFace folder needs a HuggingFace model, and this package was compiled from "
            f"{model.get('spec') or 'a function'}; save its checkpoints instead (--save-every)"
        )
    try:
        import safetensors  # noqa: F401
        import transformers  # noqa: F401
    except ImportError:
        raise PipelineConfigError(
            "a HuggingFace folder needs transformers and safetensors: pip install 'ftpipe[hf]'"
        ) from None


# What an export writes (save_pretrained, peft, the tokenizer copied): a folder holding only
# these is an earlier export, which a new one replaces whole; any other file is the user's.
EXPORTED = ("config.json", "generation_config.json", "*.safetensors", "*.safetensors.index.json",
            "adapter_config.json", "README.md", "merged", *TOKENIZER_FILES)  # fmt: skip


def check_replaceable(out) -> None:
    """Refuse to replace `out` (the export is swapped in whole) when it holds anything an
    export does not write: the user's own files would go with it."""
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise PipelineConfigError(f"{out} is a file; give a folder to write the model in")
    if not out.is_dir():
        return
    foreign = sorted(
        p.name for p in out.iterdir() if not any(fnmatch.fnmatch(p.name, e) for e in EXPORTED)
    )
    if foreign:
        raise PipelineConfigError(
            f"{out} holds files a model export does not write ({', '.join(foreign[:3])}), "
            "which replacing it would delete; give a new or empty folder"
        )


def owners(plan: dict) -> dict[str, int]:
    """Tensor name -> the stage holding it (each lives in exactly one)."""
    return {p["name"]: int(p["stages"][0]) for p in plan["params"] if p.get("stages")}


def gather_tensors(plan: dict, mine: dict, rank: int, ranks, device, dtype_of) -> dict | None:
    """Every stage's tensors on rank 0 (CPU), sent in the plan's order; None elsewhere.

    `mine`: this rank's tensors by name; `ranks`: the job rank of each GPU of the pipeline
    that sends them (rank 0's: with replicas, one pipeline of them); `dtype_of(param)`: the
    dtype its owner sends (an fp32 master copy under mixed precision), the same on every
    rank. Those ranks call this."""
    if len(ranks) == 1:
        return {k: v.detach().cpu() for k, v in mine.items()}
    rank_of = {s["id"]: ranks[int(s["gpu"])] for s in plan["stages"]}
    params = {p["name"]: p for p in plan["params"]}
    out: dict = {}
    try:
        with liveness.waiting("gathering the weights for the export"):
            for name, stage in owners(plan).items():
                src = rank_of[stage]
                if src == 0 == rank:
                    out[name] = mine[name].detach().cpu()
                elif rank == src:
                    dist.send(mine[name].detach().to(device).contiguous(), dst=0)
                elif rank == 0:
                    buf = torch.empty(
                        params[name]["shape"], dtype=dtype_of(params[name]), device=device
                    )
                    dist.recv(buf, src=src)
                    out[name] = buf.cpu()
    except PeerFailure:
        raise
    except RuntimeError as e:
        raise liveness.failure("a rank vanished while gathering the weights", e) from e
    return out if rank == 0 else None


def write_hf_folder(
    out, plan: dict, tensors: dict, tokenizer=None, max_shard_size=MAX_SHARD, say=print,
    merge_lora=False, chat_template=None,
) -> Path:  # fmt: skip
    """`out` as `save_pretrained` writes it, from the stages' tensors by name. A LoRA model
    (`plan["model"]["lora"]`): peft's adapter folder (adapter_config.json,
    adapter_model.safetensors, by peft's `save_pretrained`), and with `merge_lora` the model
    with the adapters merged in (peft's `merge_and_unload`) as a HuggingFace folder in
    `out/merged`."""
    check_exportable(plan)
    check_replaceable(out)
    from ..models.hf import build_model
    from ..models.lora import wrap

    model = plan["model"]
    net = build_model(model["config"], model["hf_class"], device="meta")
    lora = model.get("lora")
    net = wrap(net, lora)
    state = _hf_state(net, plan, tensors)
    net.load_state_dict(state, strict=True, assign=True)
    import transformers

    transformers.utils.logging.disable_progress_bar()
    out = Path(out)
    # A failed write (a full disk: safetensors raises its own error) is said by new_folder.
    needs = sum(t.nbytes for t in tensors.values()) * (2 if lora and merge_lora else 1)
    with new_folder(out, needs=needs) as tmp:
        if lora:
            # Where PeftModel.from_pretrained / AutoPeftModel find the base model.
            net.peft_config["default"].base_model_name_or_path = model.get("path") or None
            net.save_pretrained(str(tmp))
            if merge_lora:
                merged = net.merge_and_unload()
                merged.save_pretrained(str(tmp / "merged"), max_shard_size=max_shard_size)
                copy_tokenizer(tokenizer or model.get("path"), tmp / "merged", chat_template)
        else:
            net.save_pretrained(str(tmp), max_shard_size=max_shard_size)
        copied = copy_tokenizer(tokenizer or model.get("path"), tmp, chat_template)
    if not copied:
        say(f"ftpipe: note: {out} has no tokenizer (none found); pass --tokenizer FOLDER")
    return out


def _hf_state(net, plan: dict, tensors: dict) -> dict:
    """The model's state dict (every key it has) from the stages' tensors; a tied weight is
    one tensor under all its names, so save_pretrained writes it once."""
    by_name = {}
    for p in plan["params"]:
        for n in (p["name"], *p.get("aliases", ())):
            by_name.setdefault(n, p["name"])
    state, missing = {}, []
    for key in net.state_dict():
        name = by_name.get(key)
        if name is None or name not in tensors:
            missing.append(key)
        else:
            state[key] = tensors[name]
    if missing:
        found = _from_folder(plan, {k: by_name.get(k, k) for k in missing})
        state.update(found)
        missing = [k for k in missing if k not in found]
    if missing:  # frozen weights a checkpoint leaves out, started from their initial values
        found = _initial_frozen(plan, {k: by_name.get(k, k) for k in missing})
        state.update(found)
        missing = [k for k in missing if k not in found]
    if missing:
        raise PipelineConfigError(
            f"no stage holds {missing[0]} ({len(missing)} tensors of the model are missing); "
            "was the package compiled from another model?"
        )
    return state


def _from_folder(plan: dict, keys: dict[str, str]) -> dict:
    """Tensors no stage holds (the loss never reads them) or a checkpoint leaves out (frozen
    weights) from the compiled model's folder; `keys`: model key -> plan name, whose aliases
    (the folder's names of a LoRA model's base weights) are looked up too."""
    folder = plan["model"].get("path")
    aliases = {p["name"]: tuple(p.get("aliases", ())) for p in plan["params"]}
    found = {}
    for f in sorted(Path(folder).glob("*.safetensors")) if folder else []:
        from safetensors import safe_open

        with safe_open(str(f), framework="pt") as handle:
            held = set(handle.keys())
            for key, name in keys.items():
                stored = next((n for n in (key, name, *aliases.get(name, ())) if n in held), None)
                if stored is not None and key not in found:
                    found[key] = handle.get_tensor(stored)
    return found


def _initial_frozen(plan: dict, keys: dict[str, str]) -> dict:
    """Frozen weights of a model compiled without weights: the stages' seeded initial values
    (`weights.initial_value`; a run started with --init had others: export it at its end)."""

    params = {p["name"]: p for p in plan["params"] if p.get("frozen")}
    found = {}
    for key, name in keys.items():
        p = params.get(name)
        if p is not None:
            found[key] = initial_value(name, tuple(p["shape"]), getattr(torch, p["dtype"]))
    return found


def copy_tokenizer(folder, out: Path, chat_template=None) -> list[str]:
    """Copy the tokenizer files of `folder` into `out`; the names copied. `chat_template`: the
    Jinja file the run rendered its chat data with (`--chat-template`), written as the
    folder's chat_template.jinja, so `apply_chat_template` on the export renders as training
    did (AutoTokenizer takes that file over a template in tokenizer_config.json)."""
    if not folder or not Path(folder).is_dir():
        return []
    names = sorted({p.name for pat in TOKENIZER_FILES for p in Path(folder).glob(pat)})
    for name in names:
        if (Path(folder) / name).is_file():
            shutil.copyfile(Path(folder) / name, out / name)
    if chat_template:
        shutil.copyfile(chat_template, out / "chat_template.jinja")
    return names


def export_checkpoint(
    plan: dict, root, step: int | None, out, tokenizer=None, max_shard_size=MAX_SHARD, say=print,
    merge_lora=False, chat_template=None,
) -> tuple[int, Path]:  # fmt: skip
    """Write the HuggingFace folder of checkpoint `step` (the newest complete one: None)."""
    check_exportable(plan)
    check_replaceable(out)
    ckpt = Checkpoints(root, 0, int(plan["gpus"]), {"plan": plan_hash(plan)}, keep=0)
    complete = dict(ckpt.complete())
    if not complete:
        raise PipelineConfigError(f"{root} holds no complete checkpoint")
    if step is None:
        step = max(complete)
    if step not in complete:
        raise PipelineConfigError(
            f"{root} has no complete checkpoint of step {step}; it has {sorted(complete)}"
        )
    manifests = complete[step]
    saved = next((m.get("run", {}).get("plan") for m in manifests if "run" in m), None)
    if saved != plan_hash(plan):
        raise PipelineConfigError(
            f"{step_dir(root, step)} was saved by another plan; export it with its own package"
        )
    why = ckpt.damaged(manifests)
    if why:
        raise PipelineConfigError(f"{step_dir(root, step)} is damaged ({why})")
    tensors = {}
    for s in sorted({int(x["id"]) for x in plan["stages"]}):
        path = step_dir(root, step) / f"stage-{s}.safetensors"
        try:
            tensors.update(read_tensors(path))
        except (FileNotFoundError, ValueError) as e:
            raise PipelineConfigError(f"cannot read {path} ({e})") from None
    return step, write_hf_folder(
        out, plan, tensors, tokenizer, max_shard_size, say, merge_lora, chat_template
    )


def shard_size(text: str) -> int:
    """An argparse type: bytes, or a whole number of KB, MB, GB or TB (`5GB`)."""
    found = re.fullmatch(r"\s*(\d+)\s*([KMGT]B)?\s*", text, re.IGNORECASE)
    if found is None or int(found[1]) == 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size; give e.g. 5GB, 500MB or bytes")
    unit = (found[2] or "B").upper()
    return int(found[1]) * 1000 ** "BKMGT".index(unit[0])


def main(config: ExportConfig, plan_path) -> int:
    """`python -m <package> export` (its options: `job.config.ExportConfig`): one sentence and
    exit status 1 on bad input."""
    try:
        plan = read_plan(plan_path).to_dict()  # as the exporters read it
        root = config.checkpoint_dir or default_dir(plan)
        step, out = export_checkpoint(
            plan, root, config.step, config.output, config.tokenizer, config.max_shard_size,
            merge_lora=config.merge_lora, chat_template=config.chat_template,
        )  # fmt: skip
    except (PipelineConfigError, WriteFailed) as e:
        print(f"ftpipe: {e}", file=sys.stderr)
        return 1
    print(f"wrote {out} from step {step} of {root}")
    return 0
