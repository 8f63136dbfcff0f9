"""What a run records for people to look at: JSON lines, TensorBoard scalars, Weights & Biases.

    log = RunLog("runs/exp1", rank=0)     # runs/exp1/log.jsonl and runs/exp1/tensorboard/
    log = RunLog(None, rank=0, jsonl="steps.jsonl", tensorboard="tb", wandb="my-project")
    log.record("train", step=3, loss=4.1, lr=1e-3, samples_per_s=812.0)
    log.record("eval", step=5, loss=3.9, perplexity=49.4)
    log.memory(step=3, peaks={"allocated": 2**30, "reserved": 2**31})  # every rank
    log.close()

Rank 0 writes the JSON lines (one object per line: kind, step, figures; `--log-jsonl FILE`,
else `log.jsonl` in `--log-dir`), the scalars `train/*`, `eval/*` to TensorBoard
(`--tensorboard DIR`, else `tensorboard/` in `--log-dir`) and to Weights & Biases
(`--wandb PROJECT`; WANDB_MODE=offline keeps the run on disk for `wandb sync`); every rank
writes its own peak memory (`memory.Memory`: allocated and reserved) under
`<tensorboard>/rank-<r>`. The JSON-lines file is rewritten whole through the atomic writer,
at most every `flush_s` seconds and at the end, so a crash leaves the previous complete
file. TensorBoard and wandb are optional packages: asked for by name (`--tensorboard`,
`--wandb`) and not installed, the run stops before it starts, saying what to install;
under `--log-dir` alone, a missing tensorboard is said once and skipped. A write that
fails (a full disk) is a `WriteFailed` in either; TensorBoard's writer thread raises its
failure again in the next call, so the thread's own traceback is not printed.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

from ..atomic import (
    check_writable_file,
    check_writable_folder,
    failure_reason,
    file_in_the_way,
    write_atomic,
)
from ..errors import PipelineConfigError, WriteFailed

__all__ = ["RunLog"]


class RunLog:
    def __init__(
        self,
        folder,
        rank: int,
        flush_s: float = 5.0,
        say=print,
        *,
        jsonl=None,
        tensorboard=None,
        wandb: str | None = None,
        config: dict | None = None,
    ):
        """`folder` (--log-dir): log.jsonl and tensorboard/ in it, where `jsonl` and
        `tensorboard` do not say otherwise; `wandb`: the W&B project; `config`: the run's
        options, for W&B."""
        self.folder = Path(folder) if folder is not None else None
        self.rank, self.flush_s = rank, flush_s
        self.lines: list[str] = []
        self._flushed = 0.0
        self.board = self.wandb = None
        jsonl = jsonl or (self.folder / "log.jsonl" if self.folder is not None else None)
        self.jsonl = Path(jsonl) if jsonl is not None else None
        board = tensorboard or (self.folder / "tensorboard" if self.folder is not None else None)
        self.board_dir = Path(board) if board is not None else None
        if self.folder is not None:
            try:
                self.folder.mkdir(parents=True, exist_ok=True)
            except OSError as e:  # a file there, or a folder that cannot be made
                why = "it is a file" if self.folder.is_file() else failure_reason(e, self.folder)
                raise WriteFailed(f"cannot make the log folder {self.folder}: {why}") from None
            check_writable_folder(self.folder, f"the log folder {self.folder}")
        if self.jsonl is not None and rank == 0:
            self.jsonl.parent.mkdir(parents=True, exist_ok=True)
            check_writable_file(self.jsonl, "--log-jsonl")
        if self.board_dir is not None:
            self._open_board(named=tensorboard is not None, say=say)
        if wandb and rank == 0:
            self.wandb = _open_wandb(wandb, config or {})

    def _open_board(self, named: bool, say) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            if named:
                raise PipelineConfigError(
                    "--tensorboard needs the tensorboard package: pip install tensorboard "
                    "(or ftpipe[tensorboard]), or leave --tensorboard out"
                ) from None
            if self.rank == 0:
                say("ftpipe: note: tensorboard is not installed; logging JSON lines only")
            self.board_dir = None
            return
        _quiet_board_threads()
        up = file_in_the_way(self.board_dir)  # (SummaryWriter would say "Not a directory")
        if up is not None:
            raise WriteFailed(
                f"cannot make the TensorBoard folder {self.board_dir}: {up} is a file"
            )
        board = self.board_dir / f"rank-{self.rank}"
        before = set(board.iterdir()) if board.is_dir() else set()
        try:
            self.board = self._board(SummaryWriter, str(board))
        except WriteFailed:  # the event file it began is no log: it goes
            for made in set(board.iterdir()) - before if board.is_dir() else ():
                made.unlink(missing_ok=True)
            raise

    def _board(self, call, *args):
        """`call(*args)` of TensorBoard's writer; its failed write said in one sentence."""
        try:
            return call(*args)
        except OSError as e:
            where = self.board_dir
            raise WriteFailed(f"cannot write {where}: {failure_reason(e, where)}") from e

    @property
    def path(self) -> Path | None:
        """The JSON-lines file (rank 0), or None."""
        return self.jsonl

    def record(self, kind: str, step: int, **figures) -> None:
        """One line of the JSON-lines log (rank 0) and its scalars under `kind/`."""
        if self.rank != 0:
            return
        if self.jsonl is not None:
            self.lines.append(json.dumps({"kind": kind, "step": step, **figures}))
        scalars = {
            f"{kind}/{name}": value
            for name, value in figures.items()
            if isinstance(value, (int, float)) and not isinstance(value, bool)
        }
        if self.board is not None:
            for name, value in scalars.items():
                self._board(self.board.add_scalar, name, value, step)
        if self.wandb is not None:
            self.wandb.log(scalars, step=step)
        if time.monotonic() - self._flushed >= self.flush_s:
            self.flush()

    def memory(self, step: int, peaks: dict[str, int]) -> None:
        """This rank's peak memory so far (`memory.Memory.peaks`), as scalars of its own
        TensorBoard run: memory/allocated_GiB, memory/reserved_GiB."""
        if self.board is not None:
            for what, n in peaks.items():
                self._board(self.board.add_scalar, f"memory/{what}_GiB", n / 2**30, step)

    def flush(self) -> None:
        if self.rank == 0 and self.lines and self.jsonl is not None:
            write_atomic(self.jsonl, "\n".join(self.lines) + "\n")
        if self.board is not None:
            self._board(self.board.flush)
        self._flushed = time.monotonic()

    def close(self) -> None:
        self.flush()
        if self.board is not None:
            self._board(self.board.close)
        if self.wandb is not None:
            self.wandb.finish()

    def where(self) -> list[str]:
        """Where this log goes, for the run's first lines."""
        out = [f"step log {self.jsonl}"] if self.jsonl is not None else []
        if self.board is not None:
            out.append(f"TensorBoard {self.board_dir}")
        if self.wandb is not None:
            out.append(f"W&B project {self.wandb.project} ({self.wandb.settings.mode} mode)")
        return out


def _open_wandb(project: str, config: dict):
    """A W&B run of `project` (its mode from WANDB_MODE: online by default, offline keeps
    it on disk for `wandb sync`)."""
    try:
        import wandb
    except ImportError:
        raise PipelineConfigError(
            "--wandb needs the wandb package: pip install wandb (or ftpipe[wandb]), or leave "
            "--wandb out"
        ) from None
    try:
        return wandb.init(project=project, config=config)
    except Exception as e:  # noqa: BLE001 - wandb raises its own kinds (no login, no network)
        raise PipelineConfigError(
            f"cannot start the W&B run of project {project}: {e} (WANDB_MODE=offline logs "
            "without an account or network)"
        ) from None


def _quiet_board_threads() -> None:
    """Leave TensorBoard's writer-thread failures to the call that raises them again."""
    previous = threading.excepthook
    if getattr(previous, "ftpipe_quiet_board", False):
        return

    def hook(failure):  # threading.ExceptHookArgs
        board = type(failure.thread).__module__.startswith("tensorboard.")
        if board and failure.exc_type is OSError:
            return
        previous(failure)

    hook.ftpipe_quiet_board = True
    threading.excepthook = hook
