"""The `ftpipe` click group. Every command's errors arrive here as FtpipeError, once; the
commands are added in `cli/__init__.py`, one module each."""

from __future__ import annotations

from importlib import import_module

import click
from click.utils import make_default_short_help
from ftpipe_runtime.errors import WriteFailed
from ftpipe_runtime.job.signals import noting, starting, stopped

from ..errors import FtpipeError
from ..version import __version__


class _Group(click.Group):
    """Turns an FtpipeError (or a failed write) from any command into one line on stderr and
    exit code 1, Ctrl-C into one line and exit code 130 (SIGTERM: 143), and any other error
    into one line (`--debug` shows its traceback) and exit code 1.

    Its commands load when one runs (`lazy`: name -> module, attribute, the help's first
    line), so `ftpipe --help` and `ftpipe models` never load torch."""

    lazy: dict[str, tuple[str, str, str]] = {}

    def list_commands(self, ctx):
        return sorted({*self.commands, *self.lazy})

    def get_command(self, ctx, name):
        if name not in self.commands and name in self.lazy:
            module, attribute, _ = self.lazy[name]
            with starting("ftpipe"):  # Ctrl-C while it imports: one line, not a traceback
                found = import_module(module, __package__)
            self.add_command(getattr(found, attribute), name)
        return super().get_command(ctx, name)

    def format_commands(self, ctx, formatter):
        # The help's first sentences as declared, shortened as click shortens a command's own:
        # listing them must not import every command.
        names = self.list_commands(ctx)
        limit = formatter.width - 6 - max(map(len, names), default=0)
        rows = [
            (name, make_default_short_help(self.lazy[name][2], limit) if name not in self.commands
             else self.commands[name].get_short_help_str(limit))
            for name in names
        ]  # fmt: skip
        if rows:
            with formatter.section("Commands"):
                formatter.write_dl(rows)

    def parse_args(self, ctx, args):
        ctx.meta["ftpipe.argv"] = list(args)  # for the headers of what we generate
        return super().parse_args(ctx, args)

    def invoke(self, ctx):
        try:
            return self._stops_noted(ctx)
        except (FtpipeError, WriteFailed) as e:
            if (ctx.obj or {}).get("debug"):
                if getattr(e, "detail", ""):  # what a library printed before failing (trace.py)
                    click.echo(e.detail, err=True, nl=False)
                raise
            raise click.ClickException(str(e)) from None
        except KeyboardInterrupt as e:  # Ctrl-C, or SIGTERM (signals.Terminated)
            if (ctx.obj or {}).get("debug"):
                raise
            why, code = stopped(e, "outputs that existed are unchanged.")
            click.echo(why[0].upper() + why[1:], err=True)
            ctx.exit(code)
        except (click.ClickException, click.exceptions.Exit, click.Abort):
            raise  # click's own: a usage error's line, an exit code
        except BrokenPipeError:  # `ftpipe simulate plan.json | head`: the reader has gone
            _quiet_stdout()
            ctx.exit(SIGPIPE_EXIT)
        except Exception as e:  # noqa: BLE001 - a bug, or memory: one line, not a traceback
            if (ctx.obj or {}).get("debug"):
                raise
            raise click.ClickException(_unexpected(e)) from None

    def _stops_noted(self, ctx):
        """The command; an error it ends with after a Ctrl-C or SIGTERM came is that stop: a
        library wrapped the exception the signal raised into an error of its own
        (transformers' lazy import: "Could not import module"), or swallowed it."""
        with noting() as came:
            try:
                return super().invoke(ctx)
            except (click.exceptions.Exit, click.Abort):
                raise
            except Exception:
                if came:
                    raise type(came[0])() from None
                raise


SIGPIPE_EXIT = 141  # what a shell reports for a process a closed pipe stopped (128 + SIGPIPE)


def _quiet_stdout() -> None:
    """Point stdout at /dev/null, so that the interpreter's flush at exit does not raise
    into the closed pipe again (the recipe of Python's `signal` docs, "Note on SIGPIPE")."""
    import os
    import sys

    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):  # no real stdout (CliRunner): nothing to flush there
        pass


def _unexpected(e: Exception) -> str:
    text = " ".join(str(e).split())
    if isinstance(e, MemoryError) or "can't allocate memory" in text:
        return (
            f"out of memory ({text[:200] or 'MemoryError'}); make the model, --micro-batch or "
            "--seq-len smaller"
        )
    return f"unexpected error: {type(e).__name__}: {text[:200]} (--debug shows where)"


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
