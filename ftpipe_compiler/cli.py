"""The `ftpipe` command line. Every command's errors arrive here as FtpipeError, once."""

from __future__ import annotations

import json
import shlex
import sys

import click
from ftpipe_runtime.errors import WriteFailed

from .errors import FtpipeError
from .version import __version__


class _Group(click.Group):
    """Turns an FtpipeError (or a failed write) from any command into one line on stderr and
    exit code 1, and Ctrl-C into one line and exit code 130."""

    def parse_args(self, ctx, args):
        ctx.meta["ftpipe.argv"] = list(args)  # for the headers of what we generate
        return super().parse_args(ctx, args)

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except (FtpipeError, WriteFailed) as e:
            if (ctx.obj or {}).get("debug"):
                raise
            raise click.ClickException(str(e)) from None
        except KeyboardInterrupt:
            if (ctx.obj or {}).get("debug"):
                raise
            click.echo("Interrupted (Ctrl-C); outputs that existed are unchanged.", err=True)
            ctx.exit(130)


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="ftpipe")
@click.option("--debug", is_flag=True, help="Show tracebacks instead of one-line errors.")
@click.pass_context
def cli(ctx, debug):
    """Compile a model too big for one GPU into a pipeline-parallel fine-tuning package.

    \b
    ftpipe compile --model t5-3b --gpus 8     trace, profile, partition, simulate, generate
    ftpipe simulate out/t5-3b/plan.json       throughput, memory and a timeline of a plan
    torchrun --nproc_per_node 8 -m t5_3b_pipeline
    """
    ctx.obj = {"debug": debug}


def command_line() -> str:
    """The command that is running, for the headers of generated files."""
    ctx = click.get_current_context(silent=True)
    argv = ctx.meta.get("ftpipe.argv") if ctx else None
    return shlex.join(["ftpipe", *(sys.argv[1:] if argv is None else argv)])


def echo_json(obj) -> None:
    click.echo(json.dumps(obj, indent=2, sort_keys=False))


def main(argv=None) -> None:
    cli.main(args=argv, prog_name="ftpipe")


# Commands register themselves on `cli`; imported last because they import it.
from . import cli_commands  # noqa: E402, F401

for _optional in ("cli_partition", "cli_simulate", "cli_compile"):
    try:
        __import__(f"{__package__}.{_optional}")
    except ModuleNotFoundError as _e:
        if _e.name != f"{__package__}.{_optional}":
            raise
