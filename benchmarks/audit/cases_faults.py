"""Faults of a two-rank run (the package compiled for 2 ranks, run in p2/): checkpoints
damaged or of another run, resumes, ranks killed, stopped, interrupted or never started,
numbers that overflow, full disks mid-run, and torchrun itself. Exit codes (README): 0 done,
1 a failure named in one sentence (on every rank), 2 a usage error, 3 FTPIPE_FAULT's exit,
130 Ctrl-C and 143 SIGTERM (on the signalled rank and on the peers it stopped)."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

from .damage import both, copy, edit_json, full_disk, garbage, said, truncate
from .harness import Case, Package, Torchrun
from .workspace import TRAIN_TEXT, launch_ranks

__all__ = ["CASES"]

TEXT = ("--data", "../data/train.jsonl", *TRAIN_TEXT)
FAST = ("--timeout", "5")
LONG = ("--steps", "100000", "--log-every", "1", *FAST)  # interrupted long before its end
RESUME_ON = ("--steps", "6", "--save-every", "2", "--schedule", "1f1b", "--checkpoint-dir", "../ck",
             "--resume")  # fmt: skip
RESUME = (*RESUME_ON, *TEXT, *FAST)  # the good run's options, to step 6


def two(*args, **kw) -> Package:
    return Package(2, tuple(args), **kw)


def _on_line(text: str, sig, target: int, watch: int = 0, then_kill: int | None = None):
    """When rank `watch` has written `text`, send `sig` to rank `target`; with `then_kill`,
    SIGKILL that rank once the others have ended (a stopped rank stays stopped)."""

    def during(procs, folder):
        deadline = time.monotonic() + 150
        while text not in procs[watch].text() and time.monotonic() < deadline:
            if procs[watch].popen.poll() is not None:
                return
            time.sleep(0.1)
        os.kill(procs[target].popen.pid, sig)
        if then_kill is not None:
            others = [p for i, p in enumerate(procs) if i != then_kill]
            for p in others:
                try:
                    p.popen.wait(timeout=100)
                except Exception:  # noqa: BLE001 - the harness reports one still running
                    pass
            procs[then_kill].popen.kill()

    during.__doc__ = (
        f"{signal.Signals(sig).name} to rank {target} once rank {watch} logged {text!r}"
    )
    return during


def _group_signal(text: str, sig):
    """Ctrl-C in torchrun's terminal: `sig` to the whole process group (launcher and workers)."""

    def during(procs, folder):
        logs, _ = procs[0].workers
        deadline = time.monotonic() + 150
        while time.monotonic() < deadline and procs[0].popen.poll() is None:
            if any(text in f.read_text(errors="replace") for f in logs.glob("**/0/stderr.log")):
                break
            time.sleep(0.2)
        os.killpg(procs[0].popen.pid, sig)

    return during


def _earlier_run(*argv, name="ck2"):
    """A finished two-rank run whose checkpoints the case then uses."""

    @said(f"{name}/: the checkpoints of an earlier run ({' '.join(argv)})")
    def setup(folder: Path):
        launch_ranks(folder / "p2", 2, [*argv, "--checkpoint-dir", f"../{name}"],
                     folder.parent / "store-setup", folder.parent)  # fmt: skip
        for log in folder.parent.glob("rank*.log"):
            log.unlink()

    return setup


def _partial_save(folder: Path):
    """ck/step-000006/: rank 0's files of a save killed mid-way, a temporary file among them"""
    part = folder / "ck" / "step-000006"
    part.mkdir()
    for name in ("stage-0.safetensors", "stage-0.optimizer.pt"):
        (part / name).write_bytes((folder / "ck" / "step-000004" / name).read_bytes())
    (part / ".stage-1.safetensors.4242-0badc0de.tmp").write_bytes(b"half a file")


def _resumed_cleanly(folder: Path) -> str | None:
    if any(p.name.endswith(".tmp") for p in (folder / "ck").rglob("*")):
        return "a temporary file stayed"
    step = folder / "ck" / "step-000006"
    if not (step / "rank-0.json").exists() or not (step / "rank-1.json").exists():
        return "step 6 was not saved whole"
    return None


def _steps_kept(*steps: int):
    def after(folder: Path) -> str | None:
        for s in steps:
            if not (folder / "ck" / f"step-{s:06d}" / "rank-1.json").exists():
                return f"checkpoint {s} is gone"
        return None

    return after


def _complete_step_survives(folder: Path) -> str | None:
    done = folder / "disk" / "ck" / "step-000001"
    if not (done / "rank-0.json").exists() or not (done / "rank-1.json").exists():
        return "the first checkpoint is not complete"
    later = [p.name for p in (folder / "disk" / "ck").iterdir() if p.name != "step-000001"]
    return f"a partial checkpoint stayed: {later}" if later else None


@said("one of weights/model.safetensors' weights all nan")
def _a_weight_nan(folder: Path):
    import torch
    from safetensors.torch import load_file, save_file

    path = str(folder / "weights" / "model.safetensors")
    tensors = load_file(path)
    name = next(n for n in sorted(tensors) if n.endswith("mlp.down_proj.weight"))
    tensors[name] = torch.full_like(tensors[name], float("nan"))
    save_file(tensors, path, metadata={"format": "pt"})


def _set_aside(*steps: int):
    """The checkpoints --overwrite-checkpoints replaces wait whole in `ck/replaced/` until the
    new run's first checkpoint is complete."""

    def after(folder: Path) -> str | None:
        for s in steps:
            if not (folder / "ck" / "replaced" / f"step-{s:06d}" / "rank-1.json").exists():
                return f"checkpoint {s} of the replaced run is gone"
        return None

    return after


CASES = [
    # checkpoints and resumes
    Case("resume: a new run into another run's checkpoints", two("--steps", "2", "--save-every", "1", "--checkpoint-dir", "../ck", *FAST), 1, "another run", issue="32.4"),
    Case("resume: --overwrite-checkpoints, rank 1 fails before the first save", two("--steps", "4", "--save-every", "4", "--checkpoint-dir", "../ck", "--overwrite-checkpoints", *FAST, env={"FTPIPE_FAULT": "1:1:exit"}), (1, 3), "FTPIPE_FAULT stops", writes=("ck/",), after=_set_aside(2, 4)),
    Case("resume: valid, 2bw's final checkpoint resumed", two("--steps", "6", "--save-every", "2", "--schedule", "2bw", "--checkpoint-dir", "../ck2", "--resume", *FAST), 0, setup=_earlier_run("--steps", "4", "--save-every", "2", "--schedule", "2bw"), writes=("ck2/",), issue="32.5"),
    Case("resume: valid, the newest checkpoint's manifest damaged", two(*RESUME), 0, setup=truncate("ck/step-000004/rank-1.json"), writes=("ck/",), after=_steps_kept(2, 6), issue="32"),
    Case("resume: valid, a stage file of the newest checkpoint damaged", two(*RESUME), 0, setup=garbage("ck/step-000004/stage-1.safetensors", 256), writes=("ck/",), issue="32"),
    Case("resume: valid, after a save killed mid-way", two(*RESUME), 0, setup=_partial_save, writes=("ck/",), after=_resumed_cleanly, issue="32"),
    Case("resume: every checkpoint damaged", two(*RESUME), 1, "every checkpoint in ../ck is damaged; start afresh without --resume", setup=both(truncate("ck/step-000004/rank-0.json"), truncate("ck/step-000002/rank-0.json"))),
    Case("resume: another schedule", two(*[("2bw" if a == "1f1b" else a) for a in RESUME]), 1, "schedule"),
    Case("resume: another plan (the 1-rank package)", Package(1, RESUME), 1, "plan"),
    Case("resume: the checkpoint is at --steps already", two(*[("4" if a == "6" else a) for a in RESUME]), 1, "ask for more --steps"),
    Case("resume: a manifest of the wrong types", two(*RESUME), 0, setup=edit_json("ck/step-000004/rank-0.json", lambda m: m.update(files="many", run="x"), "step 4's rank-0.json: files and run as text"), writes=("ck/",)),
    # ranks and processes
    Case("ranks: 3 processes for a 2-rank plan", two("--steps", "2", ranks=3), 1, "for 2 GPUs but 3 processes", issue="32"),
    Case("ranks: the 2-rank package without torchrun", Package(2, ("--steps", "2"), ranks=1, world_env=False), 1, "torchrun --nproc_per_node 2"),
    Case("ranks: RANK and WORLD_SIZE set, no MASTER_ADDR", Package(2, ("--steps", "2", "--timeout", "3"), ranks=1, env={"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0"}), 1, "could not reach the rendezvous env://"),
    Case("ranks: rank 1 never starts", Package(2, ("--steps", "2", "--timeout", "3"), ranks=1, meet=True, env={"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0"}), 1, "rank 1 has not started"),
    Case("ranks: rank 1 cannot start (its weights damaged)", two("--steps", "2", *FAST, rank_env={1: {"FTPIPE_WEIGHTS": "../weights"}}), 1, "rank 1", setup=both(copy("tiny-llama", "weights"), truncate("weights/model.safetensors"))),
    Case("ranks: rank 1 raises an unexpected error", two("--steps", "3", *FAST, env={"FTPIPE_FAULT": "1:1:raise"}), 1, "FTPIPE_FAULT raises", unexpected=True),
    Case("ranks: rank 0 exits after step 1", two("--steps", "3", *FAST, env={"FTPIPE_FAULT": "0:1:exit"}), (3, 1), "FTPIPE_FAULT stops"),
    Case("ranks: Ctrl-C on rank 0 mid-run", two(*LONG, "--save-every", "1", "--checkpoint-dir", "../ck3"), 130, "interrupted", during=_on_line("step 2/", signal.SIGINT, 0), issue="32.2"),
    Case("ranks: Ctrl-C on rank 1 mid-run", two(*LONG), 130, "interrupted", during=_on_line("step 2/", signal.SIGINT, 1)),
    Case("ranks: SIGTERM to rank 1 mid-run", two(*LONG), 143, "SIGTERM", during=_on_line("step 2/", signal.SIGTERM, 1)),
    Case("ranks: SIGKILL to rank 1 mid-run", two(*LONG), (1, -9), "rank 1: its connection closed", during=_on_line("step 2/", signal.SIGKILL, 1), issue="32"),
    Case("ranks: SIGSTOP to rank 1 mid-run", two(*LONG), (1, -9), "rank 1", during=_on_line("step 2/", signal.SIGSTOP, 1, then_kill=1), issue="32"),
    Case("ranks: weights of nan", two("--steps", "3", *FAST, env={"FTPIPE_WEIGHTS": "../weights"}), 1, "is nan", setup=both(copy("tiny-llama", "weights"), _a_weight_nan)),
    Case("ranks: --timeout 1e308", two("--steps", "2", "--timeout", "1e308"), 2, "must be at most 1000000000"),
    Case("ranks: a checkpoint on a full disk", two("--steps", "3", "--save-every", "1", "--checkpoint-dir", "../disk/ck", *FAST), 1, "No space left", setup=full_disk("disk", size="400k", fill=False), after=_complete_step_survives, needs_root=True, issue="32.2"),
    Case("ranks: --save-hf on a full disk", two("--steps", "2", "--save-hf", "../disk/hf", *FAST), 1, "No space left", setup=full_disk("disk", size="64k"), needs_root=True, issue="32.2"),
    Case("ranks: valid, evaluation with --save-hf and a log", two("--steps", "3", *TEXT, "--eval-data", "../data/val.jsonl", "--eval-every", "2", "--save-hf", "../out", "--log-dir", "../logs", *FAST), 0),
    # torchrun
    Case("torchrun: valid", Torchrun(2, ("--steps", "2")), 0),
    Case("torchrun: rank 0 fails mid-run, torchrun stops rank 1", Torchrun(2, ("--steps", "3", *FAST), env={"FTPIPE_FAULT": "0:1:exit"}), 1, "FTPIPE_FAULT stops"),
    Case("torchrun: its port in use (torchrun's own error)", Torchrun(2, ("--steps", "2"), port="busy"), 1, "address already in use|EADDRINUSE|Address already in use"),
    Case("torchrun: Ctrl-C in its terminal", Torchrun(2, LONG), 1, "interrupted", during=_group_signal("step 2/", signal.SIGINT)),
]  # fmt: skip
