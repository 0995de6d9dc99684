"""``fsdp-conformance coverage``: which cells an adapter would run or skip, and which
unsupported feature to implement next -- from a collection, not a run.

[Note: coverage probe]
A cell needs its check's features plus what its body asks for before it first makes the
adapter act: each body is called once with a *probe* for the adapter (an ``Adapter`` whose
declarations are the adapter's; it records what the body requires and stops the body at
``wrap`` or any other operation) and a ``dist`` without ranks. A body that cannot be probed
keeps its check's and case's features. A feature *unlocks* the cells that would run if the
adapter supported it too.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from typing import Any

from fsdp_conformance.cli import usage
from fsdp_conformance.constants import COVERAGES

JSON_SCHEMA_VERSION = 1


def report(
    impl: str, *, coverage: str = usage.DEFAULT_COVERAGE, world_size: int = 2
) -> dict[str, Any]:
    """The coverage of adapter `impl` as the JSON-ready dict ``--json`` writes (docs/cli.md)."""
    from fsdp_conformance.adapters import features as adapter_features
    from fsdp_conformance.adapters import get_adapter
    from fsdp_conformance.cli.probe import Cell, Granted, collect
    from fsdp_conformance.suite import configs

    adapter = get_adapter(impl)
    problem = adapter_features.support_problem(adapter)
    cells = collect(impl, adapter, coverage, world_size)

    def runs(cell: Cell, supports: Any) -> bool:
        return problem is None and not cell.blocked and not cell.missing(supports)

    supports = Granted(adapter).has
    now = [runs(cell, supports) for cell in cells]
    per_check: dict[str, dict[str, int]] = {}
    skipped_by: Counter = Counter()
    for cell, running in zip(cells, now):
        entry = per_check.setdefault(cell.check or "(unregistered)", {"run": 0, "skip": 0})
        entry["run" if running else "skip"] += 1
        if not running:
            missing = cell.missing(supports)
            skipped_by[problem or cell.blocked or (missing[0] if missing else "?")] += 1
    running_now = Counter(cell.check for cell, running in zip(cells, now) if running)
    unlocks = []
    dimensions = configs.supported_dimensions(Granted(adapter))
    for feature, reason in sorted(dict(adapter.declarations.unsupported).items()):
        granted = Granted(adapter, frozenset({feature}))
        then = cells  # collected again only where the feature changes the configs
        if configs.supported_dimensions(granted) != dimensions:
            then = collect(impl, adapter, coverage, world_size, granted.granted)
        running_then = Counter(cell.check for cell in then if runs(cell, granted.has))
        gains = {
            check: running_then[check] - running_now[check]
            for check in sorted(set(running_then) | set(running_now))
            if running_then[check] != running_now[check]
        }
        if (total := sum(running_then.values()) - sum(running_now.values())) > 0:
            unlocks.append({"feature": feature, "reason": reason, "cells": total, "checks": gains})
    unlocks.sort(key=lambda entry: (-entry["cells"], entry["feature"]))
    return {
        "schema": JSON_SCHEMA_VERSION,
        "impl": impl,
        "adapter": adapter.name,
        "coverage": coverage,
        "world_size": world_size,
        "support_problem": problem,
        "cells": len(cells),
        "run": sum(now),
        "skip": len(cells) - sum(now),
        "checks": dict(sorted(per_check.items())),
        "skipped_by": dict(skipped_by.most_common()),
        "unlocks": unlocks,
        "unprobed": sum(not cell.probed for cell in cells),
        "cell_list": [
            {
                "nodeid": cell.nodeid,
                "check": cell.check,
                "runs": running,
                "missing": cell.missing(supports),
                "blocked": cell.blocked,
            }
            for cell, running in zip(cells, now)
        ],
    }


def _family_counts(gains: dict[str, int]) -> str:
    families: Counter = Counter()
    for check, count in gains.items():
        families[check.partition(".")[0]] += count
    return ", ".join(f"{family} {count:+d}" for family, count in families.most_common())


def render_text(data: dict[str, Any]) -> str:
    """The report as the terminal shows it."""
    counts = f"{data['cells']} cells collected, {data['run']} would run, {data['skip']} would skip"
    lines = [f"adapter {data['adapter']!r} ({data['impl']}), coverage {data['coverage']}: {counts}"]
    if data["support_problem"]:
        lines.append(f"every cell skips: {data['support_problem']}")
    lines.append("")
    width = max((len(check) for check in data["checks"]), default=10)
    for check, counts in data["checks"].items():
        lines.append(f"  {check:<{width}}  {counts['run']:4d} run  {counts['skip']:4d} skip")
    if data["skipped_by"]:
        lines += ["", "skipped by (the first missing feature or the reason):"]
        lines += [f"  {count:4d}  {why}" for why, count in data["skipped_by"].items()]
    lines.append("")
    for entry in data["unlocks"]:
        lines.append(
            f"implement `{entry['feature']}` next: +{entry['cells']} "
            f"cell{'s' if entry['cells'] != 1 else ''} ({_family_counts(entry['checks'])})"
        )
    if not data["unlocks"]:
        lines.append("no single unsupported feature unlocks a cell")
    if unprobed := data["unprobed"]:
        lines.append(f"({unprobed} cells counted from their check's and case's features only)")
    return "\n".join(lines)


def _coverage_command(args: argparse.Namespace) -> int:
    usage.check_impl(args.impl)
    usage.check_at_least(args.world_size, "--world-size")
    if args.json not in (None, "-"):
        usage.check_output(args.json, "--json")
    try:
        data = report(args.impl, coverage=args.coverage, world_size=args.world_size)
    except RuntimeError as error:
        print(f"{usage.PROG} coverage: {error}", file=sys.stderr)
        return 1
    if args.json == "-":
        print(json.dumps(data, indent=1))
        return 0
    if args.json is not None:
        usage.write_json(args.json, data, indent=1)
    print(render_text(data))
    return 0


def add_parser(commands: Any) -> None:
    parser = usage._subcommand(
        commands,
        "coverage",
        "which cells an adapter would run or skip, and what to implement next",
        "Collect the conformance suite for one adapter (no rank starts, nothing runs) and "
        "print how many cells would run and skip, per check, and for each unsupported "
        "feature how many cells implementing it would unlock, most first.",
        "fsdp-conformance coverage --impl torch-fsdp2",
        "cd examples && fsdp-conformance coverage --impl my_fsdp_adapter:ADAPTER --json -",
    )
    usage._add_impl(parser)
    ranks = "ranks for cells that do not fix their own world size, as `run` (default 2)"
    parser.add_argument("--world-size", type=int, default=2, metavar="N", help=ranks)
    default = usage.DEFAULT_COVERAGE
    configurations = f"parity configurations as `run` collects them (default {default})"
    parser.add_argument("--coverage", choices=COVERAGES, default=default, help=configurations)
    to_json = "write the report as JSON to FILE (no FILE or '-': to stdout, instead of the text)"
    parser.add_argument("--json", nargs="?", const="-", metavar="FILE", help=to_json)
    parser.set_defaults(handler=_coverage_command)


__all__ = ["add_parser", "render_text", "report"]
