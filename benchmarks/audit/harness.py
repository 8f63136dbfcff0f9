"""One audit case: copy the workspace, damage it, run the command as a user would, check.

    result = run_case(case, base, scratch)   # Result: exit codes, the message, the problems

A case is a command (`Ftpipe`, `Package`, `Torchrun`) run in its own copy of the workspace
after `setup` damaged it, with `during` acting on the running processes (signals). The
checks, the same for every case:

- each process's exit code is the one the case expects (what README documents for it);
- no "Traceback" and no raw exception line (`ValueError: ...`) on any process's output;
- a failing process says why in one sentence: its last line of stderr is its error line
  (`ftpipe: ...`, `ftpipe rank R: ...`, click's `Error: ...`, argparse's `prog: error: ...`,
  the compiler's `Interrupted (Ctrl-C); ...` and `Stopped (SIGTERM); ...`) and it has no
  other error line (a usage synopsis and progress lines may come before);
- every file of the case folder that existed before the command is byte-identical after it,
  except the outputs the case names in `writes`; no temporary file or folder (a name
  starting with a dot) is left that was not there before;
- `after(folder)`, where given, finds nothing wrong (e.g. an injected line never ran).

torchrun's own report of a failed worker (ChildFailedError, with the launcher's traceback)
is torchrun's, not ftpipe's: its workers' output is checked as above (`--log-dir`, one file
per worker), the launcher's only for its exit code.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from benchmarks.harness.launch import child_env

from .workspace import PACKAGE

__all__ = ["Case", "Ftpipe", "Package", "Proc", "Result", "Torchrun", "run_case", "snapshot"]

ERROR_LINE = re.compile(
    r"^(ftpipe( rank \d+)?: (?!note:|warning:)|Error: |Interrupted \(Ctrl-C\)|Stopped \(SIGTERM\)|\S.*: error: )"
)
RAW_EXCEPTION = re.compile(r"^([A-Za-z_]\w*\.)*[A-Z]\w*(Error|Exception)(: |$)|^KeyboardInterrupt$")


@dataclass
class Proc:
    """One started process: its label (`rank 1`), its Popen, where its output goes."""

    label: str
    popen: subprocess.Popen
    log: Path
    checked: bool = True  # False: the launcher (torchrun), whose own report is not ftpipe's

    def text(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""


class Command:
    """How a case's command runs; `describe()` is what the table shows."""

    def start(self, folder: Path, scratch: Path) -> list[Proc]:
        raise NotImplementedError  # every command kind below defines it

    def describe(self) -> str:
        raise NotImplementedError


def _popen(cmd, cwd, env, log: Path) -> subprocess.Popen:
    with open(log, "w") as out:
        return subprocess.Popen(cmd, cwd=cwd, env=env, stdout=out, stderr=out,
                                stdin=subprocess.DEVNULL, start_new_session=True)  # fmt: skip


@dataclass(frozen=True)
class Ftpipe(Command):
    """`ftpipe ARGS` in the case folder."""

    args: tuple[str, ...]
    env: dict = field(default_factory=dict)

    def start(self, folder, scratch):
        cmd = [sys.executable, "-m", "ftpipe_compiler", *self.args]
        log = scratch / "ftpipe.log"
        return [Proc("ftpipe", _popen(cmd, folder, child_env(extra=self.env), log), log)]

    def describe(self) -> str:
        return "ftpipe " + _join(self.args)


@dataclass(frozen=True)
class Package(Command):
    """`python -m tiny_llama_pipeline ARGS` in pN/ (the package compiled for `gpus` ranks),
    on `ranks` processes meeting at a file store (no environment with one process);
    `rank_env[r]`: more variables for rank r."""

    gpus: int
    args: tuple[str, ...]
    ranks: int | None = None
    env: dict = field(default_factory=dict)
    rank_env: dict = field(default_factory=dict)
    world_env: bool = True  # False: no RANK / WORLD_SIZE (as if torchrun were forgotten)
    meet: bool | None = None  # --init-method at a file store (default: with several ranks)

    def start(self, folder, scratch):
        ranks = self.gpus if self.ranks is None else self.ranks
        cwd = folder / f"p{self.gpus}"
        procs = []
        for r in range(ranks):
            extra = dict(self.env)
            meet = []
            if ranks > 1 and self.world_env:
                extra.update(RANK=str(r), WORLD_SIZE=str(ranks), LOCAL_RANK=str(r),
                             LOCAL_WORLD_SIZE=str(ranks))  # fmt: skip
            if self.meet if self.meet is not None else ranks > 1:
                meet = ["--init-method", f"file://{scratch / 'store'}"]
            extra.update(self.rank_env.get(r, {}))
            cmd = [sys.executable, "-m", PACKAGE, *meet, *self.args]
            log = scratch / f"rank{r}.log"
            procs.append(Proc(f"rank {r}", _popen(cmd, cwd, child_env(extra=extra), log), log))
        return procs

    def describe(self) -> str:
        ranks = self.gpus if self.ranks is None else self.ranks
        env = " ".join(f"{k}={v}" for k, v in self.env.items())
        env += "".join(f" (rank {r}: {_join(f'{k}={v}' for k, v in e.items())})"
                       for r, e in self.rank_env.items())  # fmt: skip
        who = f"{ranks} ranks" if ranks > 1 else "1 process"
        return f"{env + ' ' if env else ''}python -m pkg{self.gpus} {_join(self.args)} [{who}]"


@dataclass(frozen=True)
class Torchrun(Command):
    """`torchrun --nproc_per_node N -m tiny_llama_pipeline ARGS` in pN/ (a free port of its
    own, or `port` when given: `"busy"` takes one another socket listens on)."""

    gpus: int
    args: tuple[str, ...]
    nproc: int | None = None
    port: str | None = None
    env: dict = field(default_factory=dict)

    def start(self, folder, scratch):
        nproc = self.nproc or self.gpus
        listener = None
        if self.port == "busy":
            listener = socket.socket()
            listener.bind(("127.0.0.1", 0))
            listener.listen()
            port = listener.getsockname()[1]
        else:
            port = _free_port()
        logs = scratch / "torchrun"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
               "--master-port", str(port), "--log-dir", str(logs), "--redirects", "3",
               "-m", PACKAGE, *self.args]  # fmt: skip
        env = child_env(extra=self.env)
        launcher = scratch / "launcher.log"
        procs = [Proc("torchrun", _popen(cmd, folder / f"p{self.gpus}", env, launcher), launcher,
                      checked=False)]  # fmt: skip
        procs[0].listener = listener  # kept open while torchrun runs
        procs[0].workers = (logs, nproc)
        return procs

    def describe(self) -> str:
        port = " (its port in use)" if self.port == "busy" else ""
        nproc = self.nproc or self.gpus
        env = "".join(f"{k}={v} " for k, v in self.env.items())
        return f"{env}torchrun --nproc_per_node {nproc} -m pkg{self.gpus} {_join(self.args)}{port}"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _join(args) -> str:
    out = []
    for a in args:
        a = str(a)
        a = a if re.fullmatch(r"[\w./=:,@+-]+", a) else repr(a)
        out.append(a if len(a) <= 60 else a[:57] + "...")
    return " ".join(out)


@dataclass(frozen=True)
class Case:
    name: str
    command: Command
    code: int | tuple[int, ...]  # each process's expected exit code (a tuple: per process)
    says: str = ""  # a regular expression the (first) message must match
    damage: str = ""  # what was done, in words (the table's column); default: the setup's doc
    setup: Callable[[Path], None] | None = None
    during: Callable[[list[Proc], Path], None] | None = None
    after: Callable[[Path], str | None] | None = None
    writes: tuple[str, ...] = ()  # paths (prefixes, relative) the command may change
    issue: str = ""  # "32.N": a case of issue 32's list; "" a new one
    timeout: float = 120
    needs_root: bool = False  # mounts a file system (a full or read-only disk)
    unexpected: bool = False  # an "unexpected error" is the case itself (FTPIPE_FAULT's raise)


@dataclass
class Result:
    case: Case
    codes: list[int | None]
    message: str
    problems: list[str]
    intact: bool
    seconds: float
    skipped: str = ""

    @property
    def ok(self) -> bool:
        return not self.problems and not self.skipped


def snapshot(folder: Path) -> dict[str, str]:
    """Relative path -> sha256 of every file (a symlink: its target) under `folder`."""
    out = {}
    for root, dirs, files in os.walk(folder):
        for name in files + [d for d in dirs if os.path.islink(os.path.join(root, d))]:
            p = Path(root) / name
            rel = str(p.relative_to(folder))
            if p.is_symlink():
                out[rel] = "link:" + os.readlink(p)
            elif p.is_file() and name != "ballast":
                try:
                    out[rel] = hashlib.sha256(p.read_bytes()).hexdigest()
                except OSError as e:
                    out[rel] = f"unreadable: {e.strerror}"
    return out


def _hidden(folder: Path) -> set[str]:
    found = set()
    for root, dirs, files in os.walk(folder):
        for name in dirs + files:
            if name.startswith("."):
                found.add(str((Path(root) / name).relative_to(folder)))
    return found


def run_case(case: Case, base: Path, scratch: Path, keep: bool = False) -> Result:
    folder = scratch / "case"
    shutil.rmtree(scratch, ignore_errors=True)
    scratch.mkdir(parents=True)
    shutil.copytree(base, folder, symlinks=True)
    mounts: list[Path] = []
    try:
        if case.needs_root and os.geteuid() != 0:
            return Result(case, [], "", [], True, 0.0, skipped="mounting needs root")
        try:
            if case.setup is not None:
                case.setup(folder)
        except Exception as e:  # noqa: BLE001 - the audit's own fault: the case fails
            return Result(case, [], "", [f"the audit's setup failed: {e!r:.200}"], True, 0.0)
        finally:
            mounts = _mounts(folder)
        before, hidden = snapshot(folder), _hidden(folder)
        t0 = time.perf_counter()
        procs = case.command.start(folder, scratch)
        acted = []
        try:
            if case.during is not None:
                try:
                    case.during(procs, folder)
                except Exception as e:  # noqa: BLE001 - the audit's own fault: the case fails
                    acted.append(f"the audit's action failed: {e!r:.200}")
            codes = _wait(procs, case.timeout)
        finally:
            for p in procs:
                if p.popen.poll() is None:
                    _kill_group(p.popen)
            for p in procs:
                if getattr(p, "listener", None) is not None:
                    p.listener.close()
        seconds = time.perf_counter() - t0
        problems, message = _check(case, procs, codes)
        problems += acted
        intact = _compare(before, snapshot(folder), case.writes, problems)
        left = sorted(_hidden(folder) - hidden)
        if left:
            problems.append(f"left behind: {', '.join(left[:3])}")
        if case.after is not None and (wrong := case.after(folder)):
            problems.append(wrong)
        return Result(case, codes, message, problems, intact, seconds)
    finally:
        for m in mounts:
            subprocess.run(["umount", "-l", str(m)], capture_output=True)
        if not keep:
            shutil.rmtree(scratch, ignore_errors=True)


def _mounts(folder: Path) -> list[Path]:
    """The file systems a setup mounted inside the case folder (to unmount afterwards)."""
    out = []
    with open("/proc/self/mounts") as f:
        for line in f:
            where = line.split()[1].replace("\\040", " ")
            if where.startswith(str(folder) + os.sep):
                out.append(Path(where))
    return out


def _wait(procs: list[Proc], timeout: float) -> list[int | None]:
    deadline = time.monotonic() + timeout
    codes = []
    for p in procs:
        try:
            codes.append(p.popen.wait(timeout=max(deadline - time.monotonic(), 0.1)))
        except subprocess.TimeoutExpired:
            codes.append(None)
    return codes


def _kill_group(popen: subprocess.Popen) -> None:
    try:
        os.killpg(popen.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    popen.wait()


def _workers(p: Proc) -> list[tuple[str, str]]:
    """torchrun's workers: (label, stderr + stdout) from its --log-dir."""
    logs, nproc = p.workers
    out = []
    for r in range(nproc):
        found = sorted(logs.glob(f"**/attempt_*/{r}/stderr.log"))
        text = "".join(f.read_text(errors="replace") for f in found)
        text += "".join(
            f.read_text(errors="replace") for f in logs.glob(f"**/attempt_*/{r}/stdout.log")
        )
        out.append((f"worker {r}", text))
    return out


def _check(case: Case, procs: list[Proc], codes: list) -> tuple[list[str], str]:
    """The problems of a finished run, and its message (the first failing process's line)."""
    problems = []
    want = case.code if isinstance(case.code, tuple) else (case.code,) * len(codes)
    outputs, message = [], ""
    for p, code, expected in zip(procs, codes, want):
        if code is None:
            problems.append(f"{p.label} still running after {case.timeout:g} s")
        elif code != expected:
            problems.append(f"{p.label} exit {code}, expected {expected}")
        if p.checked:
            outputs.append((p.label, p.text(), expected))
        elif hasattr(p, "workers"):  # torchrun's: each that said anything, as a rank is
            worker = 0 if expected == 0 else None
            outputs += [(label, text, worker) for label, text in _workers(p) if text.strip()]
            if expected and not any(text.strip() for _, text in _workers(p)):
                lines = p.text().strip().splitlines()  # no worker started: torchrun's own
                message = f"(torchrun's own) {lines[-1]}" if lines else ""
    for label, text, expected in outputs:
        lines = [line for line in text.splitlines() if line.strip()]
        if any("Traceback (most recent call last)" in line for line in lines):
            problems.append(f"{label}: a traceback")
        raw = [line for line in lines if RAW_EXCEPTION.match(line)]
        if raw:
            problems.append(f"{label}: a raw exception line: {raw[0][:100]}")
        if expected == 0 or (expected is not None and expected < 0):
            continue  # a success, or a process the case killed itself
        errors = [line for line in lines if ERROR_LINE.match(line)]
        if not errors:
            problems.append(f"{label}: no error line")
            continue
        if len(errors) > 1:
            problems.append(f"{label}: {len(errors)} error lines")
        if lines[-1] != errors[-1]:
            problems.append(f"{label}: its last line is not its error line")
        message = message or errors[0]
    if "unexpected error" in message and not case.unexpected:
        problems.append("not a clear sentence: an unexpected error")
    if case.says and message and not re.search(case.says, message):
        problems.append(f"the message does not say {case.says!r}")
    if case.says and not message and all(w != 0 for w in want):
        problems.append("no message")
    return problems, message


def _compare(before: dict, after: dict, writes: tuple[str, ...], problems: list) -> bool:
    changed = [
        path
        for path, digest in before.items()
        if after.get(path) != digest and not any(path.startswith(w) for w in writes)
    ]
    if changed:
        gone = [p for p in changed if p not in after]
        problems.append(
            f"{len(changed)} earlier files changed or lost (e.g. {changed[0]}"
            f"{', gone' if changed[0] in gone else ''})"
        )
    return not changed
