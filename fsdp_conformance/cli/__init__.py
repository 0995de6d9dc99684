"""``fsdp-conformance``: one module per subcommand (``run``, ``overlap``, ``timeline``,
``conformance``, ``fuzz``, ``coverage``), each with its ``add_parser`` and handler; ``cli.usage``
holds what they share. Exit codes (docs/cli.md): 0 success, 1 a check failed or the command
could not run, 2 a bad argument (one line, no traceback), 130 SIGINT, 143 SIGTERM.
"""

from __future__ import annotations

import argparse
import sys
import traceback
from collections.abc import Callable, Sequence

from fsdp_conformance.cli import conformance as _conformance
from fsdp_conformance.cli import coverage as _coverage
from fsdp_conformance.cli import fuzz as _fuzz
from fsdp_conformance.cli import overlap_table as _overlap
from fsdp_conformance.cli import run as _run
from fsdp_conformance.cli import timeline as _timeline
from fsdp_conformance.cli.overlap_table import render_overlap
from fsdp_conformance.cli.run import pytest_command
from fsdp_conformance.cli.timeline import RATE_LIMITER_RANGE, render_timeline
from fsdp_conformance.cli.usage import (
    BUILTIN_IMPLS,
    CLI_TIMEOUT_S,
    COVERAGES,
    DEFAULT_COVERAGE,
    DEFAULT_WORKERS,
    MODES,
    PROG,
    RANK_MEMORY_BYTES,
    RANKS_PER_CPU,
    BrokenAdapter,
    UsageError,
    _Parser,
    check_impl,
    check_keyword_expression,
    check_output,
    check_world_size,
    exit_codes_epilog,
    max_world_size,
    private_tempdir,
)
from fsdp_conformance.harness import signals

__all__ = [
    "BUILTIN_IMPLS", "CLI_TIMEOUT_S", "COVERAGES", "DEFAULT_COVERAGE",
    "DEFAULT_WORKERS", "MODES", "PROG", "RANKS_PER_CPU", "RANK_MEMORY_BYTES",
    "RATE_LIMITER_RANGE", "UsageError", "build_parser", "check_impl", "check_keyword_expression",
    "check_output", "check_world_size", "main", "max_world_size", "pytest_command",
    "render_overlap", "render_timeline",
]  # fmt: skip


def build_parser() -> argparse.ArgumentParser:
    formatter = argparse.RawDescriptionHelpFormatter
    parser = _Parser(
        prog=PROG,
        description="Conformance suite for Fully Sharded Data Parallel implementations.",
        epilog="examples:\n  fsdp-conformance run\n  fsdp-conformance overlap --help\n"
        "  fsdp-conformance timeline --out timeline.png",
        formatter_class=formatter,
    )
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for module in (_run, _overlap, _timeline, _conformance, _fuzz, _coverage):
        module.add_parser(commands, formatter)
    for name, command in commands.choices.items():
        command.epilog = "\n\n".join(filter(None, (command.epilog, exit_codes_epilog(name))))
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """The console script ``fsdp-conformance``."""
    parser = build_parser()
    args = parser.parse_args(argv)
    handler: Callable[[argparse.Namespace], int] = args.handler
    try:
        with signals.cli_signals(), private_tempdir():
            return handler(args)
    except UsageError as error:
        sys.stderr.write(f"{PROG} {args.command}: error: {error}\n")
        return 2
    except BrokenAdapter as error:
        sys.stderr.write("".join(traceback.format_exception(error.__cause__ or error)))
        sys.stderr.write(f"{PROG} {args.command}: error: {error} (the adapter is broken)\n")
        return 1
    except KeyboardInterrupt as interrupt:
        sys.stderr.write(f"\n{PROG} {args.command}: interrupted\n")
        return 128 + interrupt.signum if isinstance(interrupt, signals.Terminated) else 130
