"""The reliability audit (`python -m benchmarks.audit`, docs/reliability.md) on a handful of
cases: its checks catch what they are for (a traceback, an earlier file changed, a wrong exit
code), its tables are what the doc promises, and the markdown says what happened."""

from __future__ import annotations

import re

from benchmarks.audit.__main__ import CASES
from benchmarks.audit.damage import write
from benchmarks.audit.harness import Case, Ftpipe, Proc, _check, run_case
from benchmarks.audit.report import markdown


def test_the_tables_hold_enough_cases_each_named_and_described():
    names = [c.name for c in CASES]
    assert len(set(names)) == len(names)
    new = [c for c in CASES if not c.issue]
    assert len(CASES) >= 110 and len(new) >= 60, (len(CASES), len(new))
    for c in CASES:  # the table's "what was done": the command, and the damage in words
        assert c.command.describe()
        assert c.setup is None or c.damage or c.setup.__doc__, c.name


def test_the_checks_catch_what_they_are_for(tmp_path):
    base = tmp_path / "base"
    base.mkdir()
    (base / "kept.json").write_text("an earlier output")
    cases = [
        Case("a clear refusal", Ftpipe(("simulate", "nope.json")), 1, "nope.json does not exist"),
        Case("a traceback", Ftpipe(("--debug", "simulate", "nope.json")), 1),
        Case("another exit code", Ftpipe(("simulate", "--steps", "0", "kept.json")), 1),
        Case(
            "an earlier file replaced", Ftpipe(("models", "--json")), 0, setup=write("x.json", "{}")
        ),
    ]
    results = [run_case(c, base, tmp_path / f"case-{i}") for i, c in enumerate(cases)]
    ok, traceback, code, _ = results
    assert ok.ok and ok.codes == [1] and ok.message.startswith("Error: the plan file nope.json")
    assert "ftpipe: a traceback" in traceback.problems
    assert "ftpipe exit 2, expected 1" in code.problems
    assert results[3].ok and results[3].intact
    text = markdown(results, wall=60.0, base_intact=True)
    assert "4 cases (4 new, 0 from issue 32's list)" in text
    assert "2 passed, 2 failed, 0 skipped. Raw tracebacks: 1;" in text
    assert (
        "| 1 | a clear refusal |  | `ftpipe simulate nope.json` | 1 | Error: the plan file" in text
    )


def test_a_file_the_command_changes_is_caught(tmp_path):
    """`profile -o` over a file the case made: caught as a changed earlier file, unless the
    case names it among its outputs."""
    base = tmp_path / "base"
    base.mkdir()
    argv = ("profile", "-m", "gpt2-tiny", "-o", "g.json")
    setup = write("g.json", "an earlier graph")
    changed = run_case(Case("changed", Ftpipe(argv), 0, setup=setup), base, tmp_path / "a")
    assert (
        not changed.intact and "1 earlier files changed or lost (e.g. g.json)" in changed.problems
    )
    allowed = Case("allowed", Ftpipe(argv), 0, setup=setup, writes=("g.json",))
    assert run_case(allowed, base, tmp_path / "b").ok


def test_the_compilers_stop_lines_are_its_error_lines(tmp_path):
    """`ftpipe` stopped by Ctrl-C or SIGTERM ends with one line (cli/group.py): both are its
    error line. The SIGTERM one was not (the T5-3B SIGTERM case: "no error line")."""
    for code, line in [
        (130, "Interrupted (Ctrl-C); outputs that existed are unchanged."),
        (143, "Stopped (SIGTERM); outputs that existed are unchanged."),
    ]:
        log = tmp_path / f"{code}.log"
        log.write_text(f"compile: trace and profile (1.2 s)\n{line}\n")
        case = Case("stopped", Ftpipe(("compile",)), code, re.escape(line.split(";")[0]))
        assert _check(case, [Proc("ftpipe", None, log)], [code]) == ([], line)
