"""The conformance matrix of ``fsdp-conformance run`` from the records of ``cli.records``:
cells (one check in one configuration), the summary, text / Markdown / JSON."""

from __future__ import annotations

import collections
import dataclasses
import importlib.metadata
import json
import re
import textwrap
from collections.abc import Iterable
from typing import Any

from fsdp_conformance import checks

OUTCOMES = ("pass", "fail", "xfail", "xpass", "skip")
DEFAULT_CONFIGURATION = "(default)"  # of a test that is not parametrised


@dataclasses.dataclass(frozen=True)
class Cell:
    """One check in one configuration."""

    check: str  # "TestClass::test_function", or "collecting <node>" for a collection error
    configuration: str  # the parametrisation id, or DEFAULT_CONFIGURATION
    outcome: str  # one of OUTCOMES
    detail: str  # failure message / skip or xfail reason ("" for a pass)
    nodeid: str
    duration: float = 0.0  # seconds over setup, call and teardown
    # the recorded checks.Result ("" for no registered check)
    check_id: str = ""
    verdict: str = ""
    reason: str = ""
    rerun: str = ""  # the shell line re-running a failing or deviating cell alone
    # a failing or deviating check's figure (checks.PROPERTY_MEASURED): {"failure": ..., ...}
    measured: dict[str, Any] | None = None

    def figure(self) -> str:
        """The measured figure in words (``checks.describe_figure``), or ""."""
        figures = dict(self.measured or {})
        return checks.describe_figure(figures.pop("failure"), figures) if figures else ""


def split_nodeid(nodeid: str) -> tuple[str, str]:
    """``path::Class::test[id]`` -> (``Class::test``, ``id``)."""
    parts = nodeid.split("::")
    check = "::".join(parts[1:] if len(parts) > 1 else parts)
    name, bracket, configuration = check.partition("[")
    if bracket and check.endswith("]"):
        return name, configuration[:-1]
    return check, DEFAULT_CONFIGURATION


def cells_from_records(records: Iterable[dict[str, Any]]) -> list[Cell]:
    """Cells from the records plugin's JSON records, in the order tests finished."""
    cells = []
    for record in records:
        if record.get("event") == "test":
            names = ("check_id", "verdict", "reason", "rerun", "measured")
            cells.append(
                Cell(
                    *split_nodeid(record["nodeid"]), record["outcome"], record.get("detail", ""),
                    record["nodeid"], float(record.get("duration", 0.0)),
                    **{name: record[name] for name in names if name in record},
                )
            )  # fmt: skip
        elif record.get("event") == "collect_error":
            nodeid = record["nodeid"] or "(collection)"
            detail = record.get("detail", "")
            cells.append(
                Cell(f"collecting {nodeid}", DEFAULT_CONFIGURATION, "fail", detail, nodeid)
            )
    return cells


def read_records(path: str) -> list[dict[str, Any]]:
    """The records so far (a partly written last line is left for later)."""
    try:
        with open(path, encoding="utf-8") as stream:
            return [json.loads(line) for line in stream if line.endswith("\n")]
    except FileNotFoundError:
        return []


def by_check(cells: Iterable[Cell]) -> dict[str, list[Cell]]:
    """Check -> its cells sorted by configuration; checks in the order of their node ids."""
    groups: dict[str, list[Cell]] = {}
    for cell in sorted(cells, key=lambda cell: (cell.nodeid.split("[")[0], cell.configuration)):
        groups.setdefault(cell.check, []).append(cell)
    return groups


def counts(cells: Iterable[Cell]) -> dict[str, int]:
    """Outcome -> number of cells (every outcome present, zero included)."""
    return {**dict.fromkeys(OUTCOMES, 0), **collections.Counter(cell.outcome for cell in cells)}


def summary_line(cells: list[Cell], impl: str, wall_s: float) -> str:
    """``impl: 160 pass, 0 fail, 3 xfail, 2 skip (165 cells, 12 checks) in 4m12s -- conforms``."""
    total = counts(cells)
    parts = ", ".join(f"{total[o]} {o}" for o in OUTCOMES if total[o] or o in ("pass", "fail"))
    if total["fail"]:
        verdict = f"{total['fail']} FAILED"
    elif total["xfail"]:
        verdict = f"nothing failed; {total['xfail']} expected failures (documented deviations)"
    else:
        verdict = "conforms (nothing failed)"
    checks = len(by_check(cells))
    return (
        f"{impl}: {parts} ({len(cells)} cell{'' if len(cells) == 1 else 's'}, "
        f"{checks} check{'' if checks == 1 else 's'}) in {format_duration(wall_s)} -- {verdict}"
    )


def format_duration(seconds: float) -> str:
    minutes, rest = divmod(round(seconds), 60)
    return f"{minutes}m{rest:02d}s" if minutes else f"{seconds:.1f}s"


def _label(outcome: str) -> str:
    return outcome.upper() if outcome == "fail" else outcome


def render_text(cells: list[Cell], detail_width: int = 160) -> str:
    """The matrix for a terminal: per check a header with its counts, then one line per cell; a
    detail longer than ``detail_width`` is wrapped, never cut (it may carry the fix), and a
    failing or deviating cell's re-run line under it."""
    lines = []
    for check, group in by_check(cells).items():
        total = counts(group)
        tally = ", ".join(f"{total[o]} {o}" for o in OUTCOMES if total[o])
        plural = "" if len(group) == 1 else "s"
        lines.append(f"{check}  ({len(group)} configuration{plural}: {tally})")
        width = max(len(cell.configuration) for cell in group)
        for cell in group:
            line = f"  {_label(cell.outcome):<5}  {cell.configuration:<{width}}  "
            # a command in backticks stays on one line (pasted, it must run)
            kept = re.sub(r"`[^`]*`", lambda code: code.group(0).replace(" ", "\0"), cell.detail)
            parts = textwrap.wrap(
                kept, detail_width, break_long_words=False, break_on_hyphens=False
            )
            parts = [part.replace("\0", " ") for part in parts]
            lines.append((line + (parts[0] if parts else "")).rstrip())
            lines.extend(" " * len(line) + part for part in parts[1:])
            if cell.measured:
                lines.append(f"{' ' * len(line)}measured: {cell.figure()}")
            if cell.rerun:
                lines.append(f"{' ' * len(line)}re-run: {cell.rerun}")
    return "\n".join(lines)


def package_version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def _md(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def render_markdown(cells: list[Cell], header: dict[str, str], summary: str) -> str:
    """The matrix as Markdown: run facts, a table of counts per check, a table per check."""
    lines = ["# fsdp-conformance: conformance matrix", ""]
    lines += [f"- **{key}**: {_md(value)}" for key, value in header.items()]
    lines += ["", f"**{_md(summary)}**", "", "| check | " + " | ".join(OUTCOMES) + " |"]
    lines.append("|---|" + "---:|" * len(OUTCOMES))
    groups = by_check(cells)
    for check, group in groups.items():
        total = counts(group)
        lines.append(f"| `{check}` | " + " | ".join(str(total[o]) for o in OUTCOMES) + " |")
    for check, group in groups.items():
        lines += ["", f"## `{check}`", "", "| configuration | result | detail |", "|---|---|---|"]
        for cell in group:
            result = f"**{_label(cell.outcome)}**" if cell.outcome == "fail" else cell.outcome
            rerun = f"<br>measured: {_md(cell.figure())}" if cell.measured else ""
            rerun += f"<br>re-run: `{_md(cell.rerun)}`" if cell.rerun else ""
            lines.append(f"| `{_md(cell.configuration)}` | {result} | {_md(cell.detail)}{rerun} |")
    return "\n".join(lines) + "\n"


def render_json(cells: list[Cell], header: dict[str, Any]) -> str:
    """``{**header, "summary": counts, "checks": {check: counts}, "cells": [...]}``."""
    groups = by_check(cells)
    document = {
        **header,
        "summary": counts(cells),
        "checks": {check: counts(group) for check, group in groups.items()},
        "cells": [dataclasses.asdict(cell) for group in groups.values() for cell in group],
    }
    return json.dumps(document, indent=2) + "\n"
