"""`ftpipe --help` and `ftpipe models` load no torch (issue 33): the commands load when one
runs, and the help lists each command's first sentence as declared in `cli.COMMANDS`."""

from __future__ import annotations

import subprocess
import sys

import click
import pytest
from click.testing import CliRunner

from ftpipe_compiler.cli import COMMANDS, cli
from ftpipe_compiler.cli.group import _Group

# A fresh interpreter: runs `ftpipe ARGS`, then says which heavy modules it loaded.
CHILD = """
import resource, sys
from ftpipe_compiler.cli import main
try:
    main({argv!r})
except SystemExit:
    pass
used = resource.getrusage(resource.RUSAGE_SELF)
print("CPU", used.ru_utime + used.ru_stime)
print("LOADED", *sorted(m for m in ("torch", "networkx", "jinja2", "transformers")
                        if m in sys.modules))
"""


@pytest.mark.parametrize("argv", [["--help"], ["models"], ["--version"]])
def test_the_light_commands_load_no_torch(argv):
    out = subprocess.run([sys.executable, "-c", CHILD.format(argv=argv)], capture_output=True,
                         text=True, check=True).stdout  # fmt: skip
    loaded = out.rsplit("LOADED", 1)[1].split()
    assert loaded == [], f"ftpipe {' '.join(argv)} loaded {loaded}"
    # Issue 33's bound: under 0.5 s of CPU here, interpreter start included (~0.1 s measured;
    # with torch loaded it was 2.2 s).
    assert float(out.rsplit("CPU", 1)[1].split()[0]) < 0.5


def _commands_listed(group) -> str:
    return CliRunner().invoke(group, ["--help"]).output.split("Commands:")[1]


def test_the_help_lists_each_commands_own_first_sentence():
    fresh = _Group(name="probe")  # a group of its own: loading commands leaves `cli` lazy
    fresh.lazy = COMMANDS
    loaded = click.Group(name="loaded")  # click's own listing of the loaded commands
    for name, (_, _, said) in COMMANDS.items():
        command = fresh.get_command(None, name)
        assert command.help.split("\n\n")[0].strip() == said, name
        loaded.add_command(command, name)
    assert _commands_listed(cli) == _commands_listed(loaded)


def test_an_unknown_command_is_a_usage_error():
    result = CliRunner().invoke(cli, ["compiel"])
    assert result.exit_code == 2 and "No such command 'compiel'" in result.output
