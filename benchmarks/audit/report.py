"""docs/reliability.md from the audit's results: what was checked, the exit codes, the counts
and one row per case (written by `python -m benchmarks.audit`, so the doc stays true)."""

from __future__ import annotations

import datetime
import os
import platform

__all__ = ["markdown"]

INTRO = """\
# Reliability: the audit

Bad inputs and faults, each run as a user meets them: `ftpipe` commands, a generated
package on one process, on two ranks meeting at a file store, and under `torchrun`, after
damaging what the command reads (files cut short, emptied, of random bytes, of the wrong
type or shape, symlinks to themselves, folders where files belong), or with options out of
range, full and read-only disks, and signals mid-run. This file is written by the audit
itself; rerun it with

```
make audit        # = .venv/bin/python -m benchmarks.audit   (about {minutes} minutes here)
.venv/bin/python -m benchmarks.audit -k resume --keep --work /tmp/a   # some cases, folders kept
```

Each case is checked the same way (`benchmarks/audit/harness.py`):

- **exit code**: each process's is the one documented for what happened (below);
- **no traceback**: no `Traceback` and no raw exception line (`ValueError: ...`) in any
  process's output;
- **one sentence**: a process that fails says why in one line: its last line on stderr is
  its error line (`ftpipe: ...`, `ftpipe rank R: ...`, click's `Error: ...`, argparse's
  `prog: error: ...`, after a usage synopsis for usage errors, the compiler's
  `Interrupted (Ctrl-C); ...` and `Stopped (SIGTERM); ...`) and it prints no other error
  line (progress lines and notes may come before);
- **files intact**: every file in the case's folder before the command (the model, data,
  packages, an earlier run's checkpoints and export, outputs of earlier runs) is
  byte-identical afterwards, except the outputs the case asks the command to replace (a
  valid `--force`, `--save-hf` or resume), and no temporary file or folder is left behind;
  where a case says so, also what must hold after it (a pickle or an injected line never
  ran, the last complete checkpoint survives a full disk).

Cases that mount a file system (a full disk: a small tmpfs filled to its last byte; a
read-only one: a tmpfs mounted `ro`, which refuses even root) need root and are skipped
elsewhere. torchrun's own report of a failed worker (its ChildFailedError, with the
launcher's traceback) is torchrun's: for torchrun cases the workers' output is checked
(`--log-dir`, a file per worker), the launcher's only for its exit code.

## Exit codes

| code | `ftpipe` (compiler) | a package (`python -m <pkg>`, each rank) |
|---|---|---|
| 0 | done | done |
| 1 | bad input or a failure, named in one sentence | bad input, a lost or hung peer, a failed write, an unexpected error: one sentence |
| 2 | a usage error (an option's value) | a usage error (an option's value) |
| 3 | | stopped by `FTPIPE_FAULT=rank:step:exit` (the fault tests) |
| 130 | Ctrl-C | Ctrl-C, on the interrupted rank and on the peers it stopped |
| 143 | SIGTERM | SIGTERM (torchrun's stop when another worker failed), on that rank and its peers |

torchrun exits 1 when a worker failed, whatever the worker's code. A rank killed outright
(SIGKILL) ends with no line of its own (-9); its peers name it.
"""


def markdown(results: list, *, wall: float, base_intact: bool) -> str:
    ran = [r for r in results if not r.skipped]
    new = [r for r in results if not r.case.issue]
    tracebacks = sum(any("traceback" in p or "raw exception" in p for p in r.problems) for r in ran)
    lost = sum(not r.intact for r in ran)
    codes = sum(any("exit" in p or "still running" in p for p in r.problems) for r in ran)
    lines = sum(any("error line" in p for p in r.problems) for r in ran)
    failed = [r for r in ran if r.problems]
    when = datetime.date.today().isoformat()
    out = [INTRO.replace("{minutes}", f"{wall / 60:.0f}")]
    out += [
        "## Summary",
        "",
        f"{len(results)} cases ({len(new)} new, {len(results) - len(new)} from issue 32's "
        f"list), run {when} on this machine ({os.cpu_count()} cores, {platform.machine()}, "
        f"{wall / 60:.1f} minutes, two cases at a time): {len(ran) - len(failed)} passed, "
        f"{len(failed)} failed, {len(results) - len(ran)} skipped. Raw tracebacks: "
        f"{tracebacks}; files lost or changed: {lost}; exit codes other than documented: "
        f"{codes}; messages not one sentence: {lines}; the shared workspace "
        f"{'intact' if base_intact else 'CHANGED'}.",
        "",
    ]
    if failed:
        out += ["Failed:", ""]
        out += [f"- {r.case.name}: {'; '.join(r.problems)}" for r in failed]
        out += [""]
    out += [
        "## The cases",
        "",
        "Issue: `32.N` a case of issue 32's list (item N), blank a new one. Paths are relative "
        "to the case's folder; `pkgN` is the package compiled for N ranks, run in `pN/`.",
        "",
        "| # | case | issue | what was done | exit | first line of the message | files intact | ok |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for i, r in enumerate(results, 1):
        c = r.case
        done = c.damage or (c.setup.__doc__ if c.setup is not None else "") or ""
        if c.during is not None and c.during.__doc__:
            done = f"{done}; {c.during.__doc__}" if done else c.during.__doc__
        what = f"`{c.command.describe()}`" + (f"; {done}" if done else "")
        codes = "skipped" if r.skipped else ", ".join("-" if x is None else str(x) for x in r.codes)
        ok = "skipped" if r.skipped else ("yes" if r.ok else "**no**: " + "; ".join(r.problems))
        intact = "" if r.skipped else ("yes" if r.intact else "**no**")
        out.append(
            f"| {i} | {_cell(c.name)} | {c.issue} | {_cell(what)} | {codes} | "
            f"{_cell(r.message[:160])} | {intact} | {_cell(ok)} |"
        )
    return "\n".join(out) + "\n"


def _cell(text: str) -> str:
    return " ".join(str(text).split()).replace("|", "\\|")
