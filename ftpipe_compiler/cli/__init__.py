"""The `ftpipe` command line: the group (group.py) and one module per command, each loaded
when it runs (so `ftpipe --help` loads no torch).

ftpipe = ftpipe_compiler.cli:main          # setup.cfg's entry point
CliRunner().invoke(cli, ["compile", ...])  # tests
"""

from __future__ import annotations

import gc

from ftpipe_runtime.job.signals import catch_sigterm, starting

# A signal while the command line itself loads (click: tens of milliseconds, seconds on a
# busy machine) is one line too, as later while a command loads torch (group.py).
with starting("ftpipe"):
    from ftpipe_runtime import prepare_process

    from .group import cli

__all__ = ["COMMANDS", "cli", "main"]

# name: (module, attribute, the first sentence of its help, which `ftpipe --help` lists; a
# test checks it against the command's own)
COMMANDS = {
    "compile": (".compile", "compile_command", "Compile a model into a pipeline package: the "
                "plan, a report and the package to torchrun."),
    "models": (".models", "models", "The models, hardware and tasks that ship with ftpipe."),
    "partition": (".partition", "partition", "Run the partitioners on a costed graph (from "
                  "`ftpipe profile -o`) and keep the best plan."),
    "profile": (".profile", "profile", "Trace a model into an operator graph and cost every node."),
    "simulate": (".simulate", "simulate_command", "Simulate a plan: step time, samples/s, "
                 "bubble, and per GPU busy time and memory."),
}  # fmt: skip
cli.lazy = COMMANDS


def main(argv=None) -> None:
    prepare_process()  # before a command loads torch: the CPU allocator as the ranks run it
    catch_sigterm()  # SIGTERM unwinds like Ctrl-C: outputs stay whole, exit code 143
    try:
        cli.main(args=argv, prog_name="ftpipe")
    finally:
        # The command is over, its files written and closed. The interpreter's last garbage
        # collection would walk every object it made: after a compile of T5-3B (the model,
        # its traced programs, the plans), 1.4 s between the last line and the prompt.
        gc.freeze()
