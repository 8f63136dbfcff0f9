"""The `ftpipe` command line: the group (group.py) and one module per command.

ftpipe = ftpipe_compiler.cli:main          # setup.cfg's entry point
CliRunner().invoke(cli, ["compile", ...])  # tests
"""

from __future__ import annotations

from ftpipe_runtime.job.signals import catch_sigterm, starting

with starting("ftpipe"):  # Ctrl-C while the commands import: one line, not a traceback
    from .compile import compile_command
    from .group import cli
    from .models import models
    from .partition import partition
    from .profile import profile
    from .simulate import simulate_command

__all__ = ["cli", "main"]

for _command in (compile_command, models, partition, profile, simulate_command):
    cli.add_command(_command)


def main(argv=None) -> None:
    catch_sigterm()  # SIGTERM unwinds like Ctrl-C: outputs stay whole, exit code 143
    cli.main(args=argv, prog_name="ftpipe")
