"""Rank processes forked from a warm interpreter instead of started cold.

Every rank of a test pipeline used to be a fresh `python runtime_toy.py ...` or `python -m pkg`,
and each spent ~4.5 s of CPU importing torch (and torch._dynamo, through its optimizer) before
doing anything else, where a toy's three steps take a fraction of a second; a suite of several
hundred runs on 2 cores spent minutes so. A server (`python rank_server.py`; two, `SEEDS`, for
the even and the odd ranks, so that neighbouring ranks keep distinct hash seeds as cold ones
have) imports them once and,
asked, forks a child that becomes the rank: its environment, working directory and argv set,
stdout and stderr written to the rank's log, the script or module run as `__main__`, and the
interpreter's own exit imitated (SystemExit's code, a traceback and 1 for an uncaught
exception, death by SIGINT after an uncaught KeyboardInterrupt, non-daemon threads joined and
atexit run first). The child is still its own process: signals, exit codes and pids behave as
a cold one's (`ForkedRank` is the little of `subprocess.Popen` the tests use).

What a cold start has that a forked one does not: torch loaded before the rank's own code ran,
under the server's environment. A server is started with the rank's variables that are read
then (PYTHONPATH, OMP_NUM_THREADS, the CPU allocator's), and for a generated package, whose
__init__ calls `ftpipe_runtime.prepare_process()` before torch loads, it made that call first
(`prepared`); the per-run variables (FTPIPE_*) are read later, and set before the rank's code
runs. And the resident set starts with the server's pages: the tests that measure a rank's
memory start cold ranks (`runtime_helpers.COLD`).
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import threading

from ftpipe_runtime.job.cpu_allocator import VARIABLE  # (no torch: safe before it loads)

# --- the server: `python rank_server.py`, requests on stdin, answers on stdout ---


def serve(prepared: bool) -> None:
    """`prepared`: the process settings a generated package applies before torch loads
    (`ftpipe_runtime.prepare_process()`, first in its __init__), applied before torch loads."""
    before = dict(os.environ)
    if prepared:
        from ftpipe_runtime.job.cpu_allocator import prepare_process

        prepare_process()
    settings = {k: v for k, v in os.environ.items() if before.get(k) != v}
    # The imports every training rank pays, paid once: torch (~2.5 s of CPU), and torch._dynamo
    # (~2 s more), which torch.optim's first optimizer imports. Neither starts a thread with
    # OMP_NUM_THREADS=1, so the fork copies a whole process.
    import torch._dynamo  # noqa: F401

    _say("ready")
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C on pytest ends it by its stdin
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_r, False)
    os.set_blocking(wake_w, False)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # a child's end wakes the select below
    signal.set_wakeup_fd(wake_w, warn_on_full_buffer=False)
    pending = b""
    while True:
        ready, _, _ = select.select([0, wake_r], [], [])
        if wake_r in ready:
            while _drained(wake_r):
                pass
        _reap()
        if 0 in ready:
            data = os.read(0, 1 << 16)
            if not data:  # the test process is gone: no output pending, nothing to finalise
                os._exit(0)
            pending += data
            while b"\n" in pending:
                line, pending = pending.split(b"\n", 1)
                pid = os.fork()
                if pid == 0:
                    os.close(wake_r)
                    os.close(wake_w)
                    os._exit(_become(json.loads(line), settings))
                _say(f"pid {pid}")


def _drained(fd: int) -> bool:
    try:
        return bool(os.read(fd, 512))
    except BlockingIOError:
        return False


def _reap() -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        _say(f"exit {pid} {os.waitstatus_to_exitcode(status)}")


def _say(line: str) -> None:
    os.write(1, (line + "\n").encode())  # unbuffered: a child inherits no pending output


def _become(req: dict, settings: dict) -> int:
    """In the forked child: be `python ARGV` as a cold process would; returns its exit code.
    `settings`: what prepare_process() set in the server's environment."""
    signal.set_wakeup_fd(-1)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)  # a fresh interpreter's
    null = os.open(os.devnull, os.O_RDONLY)
    log = os.open(req["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(null, 0)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(null)
    os.close(log)
    os.environ.clear()
    os.environ.update(req["env"])
    os.environ.update({k: v for k, v in settings.items() if k not in req["env"]})
    os.chdir(req["cwd"])
    interrupted, code = False, 0
    try:
        _run_main(req["argv"])
    except SystemExit as stop:
        code = _exit_code(stop.code)
    except KeyboardInterrupt:
        sys.excepthook(*sys.exc_info())
        interrupted, code = True, 1
    except BaseException:
        sys.excepthook(*sys.exc_info())
        code = 1
    # What the interpreter does on its way out, in its order.
    threading._shutdown()  # joins non-daemon threads (as multiprocessing's children do)
    import atexit

    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    if interrupted:  # Python dies of the SIGINT it did not handle (returncode -2)
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    return code


def _run_main(argv: list[str]) -> None:
    import runpy

    if argv[0] == "-m":
        sys.argv = [argv[1], *argv[2:]]
        sys.path[0] = os.getcwd()
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = list(argv)
        sys.path[0] = os.path.dirname(os.path.abspath(argv[0]))
        runpy.run_path(argv[0], run_name="__main__")


def _exit_code(code) -> int:
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    print(code, file=sys.stderr)
    return 1


# --- the client, in the test process ---


class ForkedRank:
    """A forked rank, answering as much of `subprocess.Popen` as the tests use."""

    def __init__(self, server: _Server, pid: int):
        self.server, self.pid, self.args = server, pid, ["rank", str(pid)]

    @property
    def returncode(self) -> int | None:
        return self.server.codes.get(self.pid)

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        with self.server.ended:
            if not self.server.ended.wait_for(lambda: self.pid in self.server.codes, timeout):
                raise subprocess.TimeoutExpired(self.args, timeout)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:  # ended; its code is on its way
                pass

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class _Server:
    def __init__(self, env: dict, prepared: bool):
        self.proc = subprocess.Popen(
            [sys.executable, __file__, *(["--prepared"] if prepared else [])],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
        )
        self.codes: dict[int, int] = {}
        self.ended = threading.Condition()
        self.started: list[int] = []
        self.ready = self.dead = False
        self.asking = threading.Lock()
        threading.Thread(target=self._listen, daemon=True).start()

    def _listen(self) -> None:
        for line in self.proc.stdout:
            kind, *numbers = line.split()
            with self.ended:
                if kind == b"ready":
                    self.ready = True
                elif kind == b"pid":
                    self.started.append(int(numbers[0]))
                else:
                    self.codes[int(numbers[0])] = int(numbers[1])
                self.ended.notify_all()
        with self.ended:  # the server died: nothing it forked will be reported
            self.dead = True
            self.ended.notify_all()

    def wait_ready(self) -> None:
        with self.ended:
            if not self.ended.wait_for(lambda: self.ready or self.dead, 300):
                raise AssertionError("the rank server did not import torch in 300 s")
            if not self.ready:
                raise AssertionError(f"the rank server died (exit {self.proc.poll()})")

    def fork(self, argv: list[str], env: dict, cwd: str, log: str) -> ForkedRank:
        request = json.dumps({"argv": argv, "env": env, "cwd": cwd, "log": log})
        with self.asking, self.ended:
            count = len(self.started)
            self.proc.stdin.write(request.encode() + b"\n")
            self.proc.stdin.flush()
            if not self.ended.wait_for(lambda: len(self.started) > count or self.dead, 120):
                raise AssertionError("the rank server did not fork in 120 s")
            if len(self.started) == count:
                raise AssertionError(f"the rank server died (exit {self.proc.poll()})")
            return ForkedRank(self, self.started[count])


_SERVERS: dict[tuple, _Server] = {}
# Servers per kind of rank (toy or package): rank r is forked from server r % SEEDS. Two keep the
# string hashes of a 2-rank run's ranks apart (set orders differ between them, as between cold
# ranks); each costs ~220 MB held (tests/runtime/train and test_generated, -n 2: a peak of
# 5.0 GB summed PSS with one per rank index, 2.8 GB cold).
SEEDS = 2


def _read_before_torch(env: dict) -> dict:
    """The variables torch, or prepare_process() before it, reads when it loads: a server
    is started with the rank's own."""
    names = ("PYTHONPATH", "OMP_NUM_THREADS", "GLIBC_TUNABLES", VARIABLE)
    mine = {k: v for k, v in env.items() if k in names or k.startswith("MALLOC_")}
    return dict(sorted(mine.items()))


def _server(index: int, env: dict, prepared: bool) -> _Server:
    """The server of rank `index` with `env`, started if need be (it may still be importing)."""
    early = _read_before_torch(env)
    key = (index % SEEDS, prepared, tuple(early.items()))
    server = _SERVERS.get(key)
    if server is None or server.proc.poll() is not None:
        base = {k: v for k, v in os.environ.items() if k not in _read_before_torch(os.environ)}
        base.pop("PYTEST_CURRENT_TEST", None)
        server = _SERVERS[key] = _Server({**base, **early}, prepared)
    return server


def warm(ranks: list[tuple[int, dict]], prepared: bool = False) -> None:
    """Start the servers of these (index, env) ranks and wait until each has its imports done,
    so that a run's ranks start together, as cold ones do: forked while the next rank's server
    still imports torch, a rank would wait for that one past a short --timeout."""
    servers = [_server(index, env, prepared) for index, env in ranks]
    for server in servers:
        server.wait_ready()


def fork_rank(
    index: int, argv: list[str], env: dict, cwd: str | None, log: str, prepared: bool = False
) -> ForkedRank:
    """Start `python ARGV` as rank `index` with `env` (a full environment) in `cwd` (None: this
    process's), its stdout and stderr to `log`, forked from a server holding torch imported;
    `prepared`: ARGV calls `ftpipe_runtime.prepare_process()` before torch loads (a generated
    package does), so the server did too."""
    server = _server(index, env, prepared)
    server.wait_ready()
    open(log, "w").close()  # there when this returns, as Popen's redirected output is
    return server.fork(argv, env, cwd or os.getcwd(), str(log))


def shut_down() -> None:
    """End the servers (their stdin closed) and wait for them: their children's CPU time is
    then counted in this process's, as a cold rank's is."""
    for server in _SERVERS.values():
        server.proc.stdin.close()
    for server in _SERVERS.values():
        try:
            server.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.proc.kill()
            server.proc.wait()
    _SERVERS.clear()


if __name__ == "__main__":
    serve(prepared="--prepared" in sys.argv)
