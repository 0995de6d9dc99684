"""``fsdp-conformance conformance``: the suite once per implementation, written as the check x
implementation table (built by ``cli.table``)."""

from __future__ import annotations

import argparse
from typing import Any

from fsdp_conformance.cli import usage
from fsdp_conformance.constants import BUILTIN_ADAPTERS, COVERAGES


def _conformance_command(args: argparse.Namespace) -> int:
    impls = args.impl or list(BUILTIN_ADAPTERS)
    for impl in impls:
        if impl not in BUILTIN_ADAPTERS:  # a built-in without its extra gets a column saying so
            usage.check_impl(impl)
    usage.check_keyword_expression(args.k)
    usage.check_output(args.out, "--out")
    usage.check_worker_count(args.workers)
    pytest_args = [f"--fsdp-coverage={args.coverage}", f"--fsdp-timeout={args.timeout:g}"]
    if args.workers > 0:
        pytest_args += ["-n", str(args.workers)]
    if args.k:
        pytest_args += ["-k", args.k]
    from fsdp_conformance.cli import table  # imports the suite (and torch)

    table.generate(impls, args.out, pytest_args)
    print(f"{usage.PROG} conformance: wrote {args.out}")
    return 0


def add_parser(commands: Any) -> None:
    conformance = usage._subcommand(
        commands,
        "conformance",
        "run the suite per implementation and write the check x implementation table",
        "Run the conformance suite once per implementation (--impl, repeatable; default every "
        "built-in adapter) and write the check x implementation table: pass / deviation (the "
        "declared reason) / not applicable (the missing feature) / FAIL, with the versions "
        "and the date. An implementation that is not installed says so in its cells.",
        "fsdp-conformance conformance --out docs/conformance.md",
        "fsdp-conformance conformance --impl impl --impl torch-fsdp1 -k MemoryBound",
    )
    repeatable = "an implementation (repeatable)"
    conformance.add_argument("--impl", action="append", metavar="NAME", help=repeatable)
    conformance.add_argument("--out", default="docs/conformance.md", metavar="FILE.md")
    conformance.add_argument("-k", metavar="EXPR", help="only checks matching this expression")
    conformance.add_argument("--coverage", choices=COVERAGES, default=usage.DEFAULT_COVERAGE)
    conformance.add_argument(
        "-n", dest="workers", type=int, default=0, metavar="WORKERS", help="xdist workers"
    )
    usage._add_timeout(conformance)
    conformance.set_defaults(handler=_conformance_command)
