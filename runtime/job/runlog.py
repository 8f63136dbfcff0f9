"""What a run records for people to look at: JSON lines, and TensorBoard scalars where installed.

    log = RunLog("runs/exp1", rank=0)     # runs/exp1/log.jsonl and runs/exp1/tensorboard/
    log.record("train", step=3, loss=4.1, lr=1e-3, samples_per_s=812.0)
    log.record("eval", step=5, loss=3.9, perplexity=49.4)
    log.memory(step=3, peaks={"allocated": 2**30, "reserved": 2**31})  # every rank
    log.close()

Rank 0 writes `log.jsonl` (one object per line: kind, step, figures) and the scalars `train/*`,
`eval/*`; every rank writes its own peak memory (`report.Memory`: allocated and reserved)
under `tensorboard/rank-<r>`. The JSON-lines
file is rewritten whole through the atomic writer, at most every `flush_s` seconds and at
the end, so a crash leaves the previous complete file. TensorBoard is optional
(`pip install tensorboard`): without it the scalars are skipped, said once. A write that
fails (a full disk) is a `WriteFailed` in either; TensorBoard's writer thread raises its
failure again in the next call, so the thread's own traceback is not printed.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

from ..atomic import check_writable_folder, failure_reason, write_atomic
from ..errors import WriteFailed

__all__ = ["RunLog"]


class RunLog:
    def __init__(self, folder, rank: int, flush_s: float = 5.0, say=print):
        self.folder, self.rank, self.flush_s = Path(folder), rank, flush_s
        self.lines: list[str] = []
        self._flushed = 0.0
        self.board = None
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
        except OSError as e:  # a file there, or a folder that cannot be made
            why = "it is a file" if self.folder.is_file() else failure_reason(e, self.folder)
            raise WriteFailed(f"cannot make the log folder {self.folder}: {why}") from None
        check_writable_folder(self.folder, f"the log folder {self.folder}")
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            if rank == 0:
                say("ftpipe: note: tensorboard is not installed; logging JSON lines only")
        else:
            _quiet_board_threads()
            board = self.folder / "tensorboard" / f"rank-{rank}"
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
            where = self.folder / "tensorboard"
            raise WriteFailed(f"cannot write {where}: {failure_reason(e, where)}") from e

    @property
    def path(self) -> Path:
        return self.folder / "log.jsonl"

    def record(self, kind: str, step: int, **figures) -> None:
        """One line of the JSON-lines log (rank 0) and its scalars under `kind/`."""
        if self.rank != 0:
            return
        self.lines.append(json.dumps({"kind": kind, "step": step, **figures}))
        if self.board is not None:
            for name, value in figures.items():
                if isinstance(value, (int, float)) and not isinstance(value, bool):
                    self._board(self.board.add_scalar, f"{kind}/{name}", value, step)
        if time.monotonic() - self._flushed >= self.flush_s:
            self.flush()

    def memory(self, step: int, peaks: dict[str, int]) -> None:
        """This rank's peak memory so far (`report.Memory.peaks`), as scalars of its own
        TensorBoard run: memory/allocated_GiB, memory/reserved_GiB."""
        if self.board is not None:
            for what, n in peaks.items():
                self._board(self.board.add_scalar, f"memory/{what}_GiB", n / 2**30, step)

    def flush(self) -> None:
        if self.rank == 0 and self.lines:
            write_atomic(self.path, "\n".join(self.lines) + "\n")
        if self.board is not None:
            self._board(self.board.flush)
        self._flushed = time.monotonic()

    def close(self) -> None:
        self.flush()
        if self.board is not None:
            self._board(self.board.close)


def _quiet_board_threads() -> None:
    """Leave TensorBoard's writer-thread failures to the call that raises them again."""
    previous = threading.excepthook
    if getattr(previous, "ftpipe_quiet_board", False):
        return

    def hook(args):
        if type(args.thread).__module__.startswith("tensorboard.") and args.exc_type is OSError:
            return
        previous(args)

    hook.ftpipe_quiet_board = True
    threading.excepthook = hook
