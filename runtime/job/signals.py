"""Ctrl-C and SIGTERM as one line and an exit code (130, 143), from a command's first moment.

    with starting("ftpipe"):     # a command importing torch: a signal now ends it at once
        import torch             #   with one line (nothing is written while importing)
    catch_sigterm()              # then SIGTERM raises Terminated, which unwinds like Ctrl-C's
                                 #   KeyboardInterrupt: temporary files go, outputs stay whole
    why, code = stopped(e, "outputs that existed are unchanged")   # the line and the code
    with held():                 # Ctrl-C or SIGTERM inside waits for its end (a fork's hooks)
        pool.submit(...)
    with noting() as came:       # each one noted, even if a library swallows or wraps it
        ...

SIGTERM is what torchrun sends the other workers when one fails, and what `kill` sends;
left to its default it ends Python without a word and without running a `finally`. Only a
command (`python -m ...`, the `ftpipe` script) takes over signals while importing: a
program that imports ftpipe as a library keeps its own Ctrl-C. Imports only the standard
library (it runs before torch loads).
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from pathlib import Path

__all__ = ["Terminated", "catch_sigterm", "held", "noting", "starting", "stopped"]


class Terminated(KeyboardInterrupt):
    """SIGTERM arrived: unwinds like Ctrl-C, ends with exit code 143."""


def stopped(e: BaseException, kept: str) -> tuple[str, int]:
    """The sentence and exit code of a process stopped by `e` (Ctrl-C or SIGTERM); `kept`
    says what of its work stays."""
    if isinstance(e, Terminated):
        return f"stopped (SIGTERM); {kept}", 128 + signal.SIGTERM
    return f"interrupted (Ctrl-C); {kept}", 128 + signal.SIGINT


def catch_sigterm() -> None:
    """From now on SIGTERM raises Terminated in the main thread (where it is the default)."""
    global _catcher
    if _main_thread() and signal.getsignal(signal.SIGTERM) == signal.SIG_DFL:
        _catcher = os.getpid()
        signal.signal(signal.SIGTERM, _raise_terminated)


_catcher: int | None = None  # the process that chose to catch SIGTERM


def _raise_terminated(signum, frame):
    # A child forked with this handler (the planner's workers, before their initializer
    # sets the default) takes the default: Terminated raised inside multiprocessing's code
    # was caught there as a task's error and the worker lived on (test_matrix's SIGTERM).
    if _catcher is not None and os.getpid() != _catcher:
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)
        return
    raise Terminated()


@contextlib.contextmanager
def held():
    """Inside, Ctrl-C and SIGTERM wait: their exception is raised as the block ends. For code
    where Python drops an exception a signal handler raises: a fork runs the at-fork hooks
    (logging's among them) right after it, where "Exception ignored" is printed and the
    command goes on as if never stopped, and a signal that came during a long fork of a big
    process is handled exactly there. A child forked inside takes the signal's default
    until it sets its own handlers."""
    came: list[tuple] = []
    holder = os.getpid()

    def hold(handler):
        def wait(signum, frame):
            if os.getpid() == holder:
                came.append((handler, signum))
            else:
                signal.signal(signum, signal.SIG_DFL)
                os.kill(os.getpid(), signum)

        return wait

    try:
        with _wrapped(hold):
            yield
    finally:
        if came:
            handler, signum = came[0]
            handler(signum, None)  # as it would have run: raises


@contextlib.contextmanager
def noting():
    """Inside, each Ctrl-C and SIGTERM is noted as its handler raises: the list yielded
    holds the exceptions raised (KeyboardInterrupt, Terminated), for a caller whose
    libraries may not let one through: swallowed (a `__del__`, a bare `except`) or wrapped
    into an error of their own (torch.export's, transformers' lazy imports')."""
    came: list[BaseException] = []

    def note(handler):
        def raising(signum, frame):
            try:
                handler(signum, frame)
            except BaseException as e:
                came.append(e)
                raise

        return raising

    with _wrapped(note):
        yield came


@contextlib.contextmanager
def _wrapped(wrap):
    """Inside, SIGINT's and SIGTERM's handlers are `wrap(handler)`: only handlers that raise
    (callables; in the main thread, where they run), an ignored or default signal stays so."""
    old = {}
    if _main_thread():
        for s in (signal.SIGINT, signal.SIGTERM):
            handler = signal.getsignal(s)
            if callable(handler):
                wrapper = wrap(handler)
                wrapper.__wrapped__ = handler  # what `starting` looks through
                signal.signal(s, wrapper)
                old[s] = handler
    try:
        yield
    finally:
        for s, handler in old.items():
            signal.signal(s, handler)


@contextlib.contextmanager
def starting(prefix: str = "ftpipe"):
    """Inside, a command that is still importing ends at once on SIGINT or SIGTERM, with one
    line; the handlers are restored after (see the module)."""
    if not (_main_thread() and _a_command()):
        yield
        return
    # Only signals left to their defaults (or SIGTERM to `catch_sigterm`'s, which `ftpipe`
    # sets before its commands load; either as `held` or `noting` wrap it while a command
    # runs): one a parent ignores (a background job's Ctrl-C) stays ignored.
    defaults = {signal.SIGINT: (signal.default_int_handler,),
                signal.SIGTERM: (signal.SIG_DFL, _raise_terminated)}  # fmt: skip
    old = {s: h for s in defaults if _unwrapped(h := signal.getsignal(s)) in defaults[s]}
    signals = tuple(old)

    def stop(signum, frame):
        why, code = stopped(Terminated() if signum == signal.SIGTERM else KeyboardInterrupt(),
                            "nothing was written")  # fmt: skip
        os.write(2, f"{prefix}: {why} (while starting)\n".encode())
        os._exit(code)

    for s in signals:
        signal.signal(s, stop)
    try:
        yield
    finally:
        for s, handler in old.items():
            if signal.getsignal(s) is stop:
                signal.signal(s, handler if handler is not None else signal.SIG_DFL)


def _unwrapped(handler):
    """The handler under `held`'s and `noting`'s wrappers, however deeply nested."""
    while hasattr(handler, "__wrapped__"):
        handler = handler.__wrapped__
    return handler


def _main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


def _a_command() -> bool:
    """`python -m <module>` (argv[0] is "-m" while the module is found, then its
    `__main__.py`), or the `ftpipe` script."""
    first = sys.argv[0] if sys.argv else ""
    return first == "-m" or Path(first).name in ("__main__.py", "ftpipe")
