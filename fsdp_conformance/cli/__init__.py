"""``fsdp-conformance``: the conformance matrix, the overlap experiment, the memory timeline.

    fsdp-conformance run                                  # the suite on the reference FSDP
    fsdp-conformance run --impl torch-fsdp1 --report matrix.md
    fsdp-conformance run --impl mypkg.fsdp_adapter:ADAPTER -k parity
    fsdp-conformance overlap --limit-all-gathers false
    fsdp-conformance timeline --lag strict --out timeline.png --data timeline.json
    fsdp-conformance conformance --out docs/conformance.md
    fsdp-conformance fuzz --impl torch-fsdp2 --examples 200 --seed 0

One module per subcommand, each with its ``add_parser`` and handler: ``run`` (the suite in a
pytest subprocess with the records plugin ``cli.records``; the matrix by ``cli.report``),
``overlap`` and ``timeline`` (the suite's measurements, ``cli.ranks``, in a rank set; drawn by
``cli.draw``), ``conformance`` (``run``'s pytest per implementation, tabulated by ``cli.table``),
``fuzz`` and ``coverage``; ``cli.usage`` holds what they share.

Exit codes: 0 success (``run``: nothing failed); 1 a check failed or the experiment could not
run; 2 a bad argument (one line on stderr, never a traceback); 130 SIGINT (Ctrl-C), 143
SIGTERM. A signal to the CLI's pid alone ends any command within 10 s; every temp file of a
command and of its processes is in one private directory, removed however the command ended.
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

DEFAULT_TIMEOUT = CLI_TIMEOUT_S  # the old name of CLI_TIMEOUT_S

__all__ = [
    "BUILTIN_IMPLS", "CLI_TIMEOUT_S", "COVERAGES", "DEFAULT_COVERAGE", "DEFAULT_TIMEOUT",
    "DEFAULT_WORKERS", "MODES", "PROG", "RANKS_PER_CPU", "RANK_MEMORY_BYTES",
    "RATE_LIMITER_RANGE", "UsageError", "build_parser", "check_impl", "check_keyword_expression",
    "check_output", "check_world_size", "main", "max_world_size", "pytest_command",
    "render_overlap", "render_timeline",
]  # fmt: skip


def build_parser() -> argparse.ArgumentParser:
    """The ``fsdp-conformance`` parser with its subcommands."""
    formatter = argparse.RawDescriptionHelpFormatter
    parser = _Parser(
        prog=PROG,
        description="Conformance suite for Fully Sharded Data Parallel implementations.",
        epilog="examples:\n  fsdp-conformance run\n  fsdp-conformance overlap --help\n"
        "  fsdp-conformance timeline --out timeline.png",
        formatter_class=formatter,
    )
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    _run.add_parser(commands, formatter)
    _overlap.add_parser(commands, formatter)
    _timeline.add_parser(commands, formatter)
    _conformance.add_parser(commands, formatter)
    _fuzz.add_parser(commands, formatter)
    _coverage.add_parser(commands, formatter)
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
