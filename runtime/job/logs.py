"""The run's lines for people: Python `logging`, each line with its time and rank.

    log = setup_logging(rank=0, verbosity=0)   # -v: 1, -q: -1
    log.info("step 3/10  loss 4.1234 ...")     # rank 0's step lines are INFO
    say = sayer(log)                           # say("ftpipe: note: ...") -> a WARNING

    2026-11-27 14:33:01 rank 0 INFO     step 3/10  loss 4.1234  lr 1.00e-03 ...

Rank 0 logs INFO (its step and evaluation lines, where things go) and, with -v, DEBUG;
with -q only warnings and errors. Other ranks log warnings and errors (INFO with -v), so a
run of 8 ranks prints its step lines once. Lines go to stderr through tqdm's writer, so a
progress bar on a terminal is redrawn below them. The one line a rank stops with (an
error's sentence, `liveness.die`) is printed by itself, whatever the level.
"""

from __future__ import annotations

import logging
import sys

from tqdm import tqdm

__all__ = ["LOGGER", "setup_logging", "sayer"]

LOGGER = "ftpipe"
_FORMAT = "%(asctime)s rank {rank} %(levelname)-7s %(message)s"
_DATE = "%Y-%m-%d %H:%M:%S"


class _TqdmHandler(logging.Handler):
    """To stderr (as it is when the line is written: tests and tools replace it), through
    tqdm so a bar stays below the lines."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            tqdm.write(self.format(record), file=sys.stderr)
            sys.stderr.flush()
        except Exception:  # noqa: BLE001 - logging's own rule: never raise from a handler
            self.handleError(record)


def setup_logging(rank: int, verbosity: int = 0) -> logging.Logger:
    """The `ftpipe` logger of this rank: its level from `verbosity` (-q: -1, -v: 1 or more)."""
    if rank == 0:
        level = (
            logging.DEBUG if verbosity > 0 else logging.WARNING if verbosity < 0 else logging.INFO
        )
    else:
        level = logging.INFO if verbosity > 0 else logging.WARNING
    log = logging.getLogger(LOGGER)
    for old in list(log.handlers):  # set up again (freeze training, tests): one handler
        if isinstance(old, _TqdmHandler):
            log.removeHandler(old)
    handler = _TqdmHandler()
    handler.setFormatter(logging.Formatter(_FORMAT.format(rank=rank), _DATE))
    log.addHandler(handler)
    log.setLevel(level)
    log.propagate = False  # the application's root handlers would print it twice
    return log


def sayer(log: logging.Logger):
    """`say(line)` for the parts that report in sentences: "ftpipe: warning: ..." and
    "ftpipe: note: ..." are warnings (-q keeps them), other lines INFO."""

    def say(line: str) -> None:
        text = line.removeprefix("ftpipe: ")
        level = logging.WARNING if text.startswith(("warning:", "note:")) else logging.INFO
        log.log(level, text)

    return say
