"""What every command prints the same way: JSON, lines, and the command line for the
headers of generated files (output folders are `ftpipe_compiler.output`'s)."""

from __future__ import annotations

import json
import shlex
import sys

import click

__all__ = ["command_line", "echo_json", "echo_lines", "json_option"]


def command_line() -> str:
    """The command that is running, for the headers of generated files."""
    ctx = click.get_current_context(silent=True)
    argv = ctx.meta.get("ftpipe.argv") if ctx else None
    return shlex.join(["ftpipe", *(sys.argv[1:] if argv is None else argv)])


def echo_json(obj) -> None:
    click.echo(json.dumps(obj, indent=2, sort_keys=False))


def echo_lines(lines) -> None:
    for line in lines:
        click.echo(line)


def json_option(help: str = "Print machine-readable results."):
    return click.option("--json", "as_json", is_flag=True, help=help)
