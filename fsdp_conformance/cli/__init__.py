"""``fsdp-conformance``: one module per subcommand (``run``, ``overlap``, ``timeline``,
``conformance``, ``fuzz``, ``coverage``), each with its ``add_parser`` and handler; ``cli.usage``
holds what they share. Exit codes (docs/cli.md): 0 success, 1 a check failed or the command
could not run, 2 a bad argument (one line, no traceback), 130 SIGINT, 143 SIGTERM.
"""

from __future__ import annotations

import argparse
import sys
import traceback
from collections.abc import Sequence

from fsdp_conformance.cli import conformance, coverage, fuzz, overlap_table, run, timeline, usage
from fsdp_conformance.harness import signals

# the package exports these two; each command's names live in its module (cli.run, cli.usage, ...)
__all__ = ["build_parser", "main"]


def build_parser() -> argparse.ArgumentParser:
    """The parser of ``fsdp-conformance`` and its subcommands."""
    parser = usage._Parser(
        prog=usage.PROG,
        description="Conformance suite for Fully Sharded Data Parallel implementations.",
        epilog="examples:\n  fsdp-conformance run\n  fsdp-conformance overlap --help\n"
        "  fsdp-conformance timeline --out timeline.png",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for module in (run, overlap_table, timeline, conformance, fuzz, coverage):
        module.add_parser(commands)
    for name, command in commands.choices.items():
        command.epilog = "\n\n".join(filter(None, (command.epilog, usage.exit_codes_epilog(name))))
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """The console script ``fsdp-conformance``."""
    args = build_parser().parse_args(argv)
    try:
        with signals.cli_signals(), usage.private_tempdir():
            return args.handler(args)
    except usage.UsageError as error:
        sys.stderr.write(f"{usage.PROG} {args.command}: error: {error}\n")
        return 2
    except usage.BrokenAdapter as error:
        sys.stderr.write("".join(traceback.format_exception(error.__cause__ or error)))
        sys.stderr.write(f"{usage.PROG} {args.command}: error: {error} (the adapter is broken)\n")
        return 1
    except KeyboardInterrupt as interrupt:
        sys.stderr.write(f"\n{usage.PROG} {args.command}: interrupted\n")
        return 128 + interrupt.signum if isinstance(interrupt, signals.Terminated) else 130
