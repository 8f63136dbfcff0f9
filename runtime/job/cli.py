"""The command line of every generated package, which only hands over what is its own.

python -m t5_tiny_pipeline [options]             # train: run(plan, stages, argv)
python -m t5_tiny_pipeline --check [--json]       # the stages against the original model
python -m t5_tiny_pipeline export --checkpoint-dir D [--step N] -o DIR   # a HuggingFace folder

main(sys.argv[1:], STAGES, PLAN_PATH, package="t5_tiny_pipeline")   # the package's __main__
"""

from __future__ import annotations

import sys

__all__ = ["main"]


def main(argv: list[str], stages: dict, plan_path, package: str) -> int:
    from .signals import catch_sigterm, stopped

    catch_sigterm()
    try:
        return _main(list(argv), stages, plan_path, package)
    except KeyboardInterrupt as e:  # --check, export (a run says so itself, on every rank)
        why, code = stopped(e, "outputs that existed are unchanged")
        print(f"ftpipe: {why}", file=sys.stderr, flush=True)
        return code


def _main(argv: list[str], stages: dict, plan_path, package: str) -> int:
    from .options import use_weights

    # `--weights DIR` before anything reads the plan or builds a stage: train, --check and
    # export all read the model's folder from there.
    argv = use_weights(list(argv), prog=f"python -m {package}")

    def load_plan() -> dict:  # damaged or from another version: one sentence, not a traceback
        from ..spec.plan import read_plan

        return read_plan(plan_path).to_dict()

    if "--check" in argv:
        from .check import main as check_main

        rest = [a for a in argv if a != "--check"]
        return check_main(rest, stages, load_plan, prog=f"{package} --check")
    if argv[:1] == ["export"]:
        from ..checkpoint.hf import main as export_main
        from .config import ExportConfig

        return export_main(
            ExportConfig.parse(argv[1:], prog=f"python -m {package} export"), plan_path
        )
    from .train import run

    # The runtime constructs only the stages of its own rank: construction materialises them.
    # It reads plan.json itself, so a damaged one is one sentence, not a traceback.
    run(plan_path, stages, argv)
    return 0
