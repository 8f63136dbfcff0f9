"""A run's outputs never replace its inputs: `--log-json ../train.jsonl` wrote the summary over
the data, `--log-jsonl <pkg>/plan.json` over the package's plan, and `--save-hf` into the model's
own folder (a `save_pretrained` folder passes `check_replaceable`: it holds only what an
export writes) over the weights the package loads (the bad-input audit of 2026-11-30).

    check_outputs_spare_inputs(config, plan, stage_classes)   # one sentence, before any work

Inputs: the data and evaluation files, `--init`, `--chat-template`, and the folders of the
package, the model (its weights, as the run resolves them) and `--tokenizer`. An output file
may not be one of those files nor an existing file inside one of those folders; `--save-hf`,
a folder swapped in whole, may not be one of them or hold any of them.
"""

from __future__ import annotations

import sys
from pathlib import Path

from ..atomic import overlap
from ..errors import PipelineConfigError
from ..spec.weights import model_folder
from .config import RunConfig

__all__ = ["check_outputs_spare_inputs"]

OUTPUT_FILES = (("log_json", "--log-json"), ("log_jsonl", "--log-jsonl"), ("trace", "--trace"))
INPUT_FILES = (("data", "--data"), ("eval_data", "--eval-data"), ("init", "--init"),
               ("chat_template", "--chat-template"))  # fmt: skip


def check_outputs_spare_inputs(config: RunConfig, plan: dict, stage_classes: dict) -> None:
    inputs = _inputs(config, plan, stage_classes)
    for field, flag in OUTPUT_FILES:
        out = getattr(config, field, None)
        if not out or not Path(out).is_file():
            continue  # a new file replaces nothing
        if met := overlap(out, inputs):
            how, what, _ = met
            what = what if how == "is" else f"a file of {what}"
            raise PipelineConfigError(f"{flag} {out} is {what}; give another path")
    if config.save_hf and (met := overlap(config.save_hf, inputs, inside=False)):
        raise PipelineConfigError(
            f"--save-hf {config.save_hf} would replace {met[1]}, which the run reads; give "
            "another folder"
        )


def _inputs(config: RunConfig, plan: dict, stage_classes: dict) -> dict:
    """{what it is: resolved path}: the input files, then the input folders (each once)."""
    found = {}  # resolved path -> what it is: the first name given wins
    for field, flag in INPUT_FILES:
        value = getattr(config, field, None)
        if value and Path(value).is_file():
            found.setdefault(Path(value).resolve(), f"the {flag} file")
    package = _package_folder(stage_classes)
    if package is not None:
        found.setdefault(package, "the package")
    recorded = (plan.get("model") or {}).get("path")
    if recorded and package is not None:
        weights = Path(model_folder(recorded, package))
        if weights.is_dir():
            found.setdefault(weights.resolve(), f"the model's folder {weights}")
    if config.tokenizer and Path(config.tokenizer).is_dir():
        found.setdefault(Path(config.tokenizer).resolve(), "the --tokenizer folder")
    return {what: path for path, what in found.items()}


def _package_folder(stage_classes: dict) -> Path | None:
    """The generated package's folder (its plan.json beside its stages), or None where the
    stages come from elsewhere (a test's)."""
    for cls in stage_classes.values():
        path = getattr(sys.modules.get(cls.__module__), "__file__", None)
        if path and (Path(path).parent / "plan.json").is_file():
            return Path(path).parent.resolve()
    return None
