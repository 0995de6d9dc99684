"""The check x implementation table of ``fsdp-conformance conformance``: each implementation
runs ``run``'s pytest; its cells fold per check into the recorded verdicts, a mixed one listing
each with its count ("pass 10, deviation 4 [2]"), the reasons as numbered notes.
"""

from __future__ import annotations

import dataclasses
import datetime
import importlib.util
import os
import shlex
import subprocess
import sys
import tempfile
from collections.abc import Iterable, Sequence
from typing import Any

import fsdp_conformance.suite  # noqa: F401  (importing the suite declares its checks)
from fsdp_conformance import checks, constants
from fsdp_conformance.cli.report import _md, package_version
from fsdp_conformance.harness.extras import EXTRAS


def table_cell(cell: Any) -> checks.Result:
    """A ``cli.report.Cell`` as the verdict record the table folds (``check``: the registered
    check id, or "Class::test" for no registered check; a collection error is a FAIL)."""
    if cell.verdict:
        return checks.Result(cell.check_id or cell.check, cell.verdict, cell.reason)
    return checks.Result(cell.check, checks.FAIL, " ".join(cell.detail.split()))


@dataclasses.dataclass
class ImplResult:
    """What one implementation's run produced."""

    impl: str  # the name given to --impl (column header)
    adapter_name: str = ""  # the adapter's own name when it differs from `impl`
    cells: list[checks.Result] = dataclasses.field(default_factory=list)
    unavailable: str | None = None  # why the implementation could not run at all


def unavailable_reason(impl: str) -> str | None:
    """Why ``impl`` cannot run here (not installed / unknown), or None when it can."""
    if impl in EXTRAS and importlib.util.find_spec(impl) is None:
        return f"not installed: pip install 'fsdp-conformance[{impl}]'"
    if impl not in constants.BUILTIN_ADAPTERS and ":" not in impl:
        return (
            f"no built-in adapter {impl!r} in this fsdp-conformance "
            f"(built in: {', '.join(constants.BUILTIN_ADAPTERS)})"
        )
    return None


def run_implementation(impl: str, pytest_args: Sequence[str]) -> ImplResult:
    """The cells of ``run``'s pytest on ``impl`` with ``pytest_args``."""
    from fsdp_conformance.adapters import get_adapter
    from fsdp_conformance.cli import records, report

    if (reason := unavailable_reason(impl)) is not None:
        return ImplResult(impl, unavailable=reason)
    with tempfile.TemporaryDirectory(prefix="fsdp-conformance-table-") as workdir:
        results = os.path.join(workdir, "results.jsonl")
        command = records.suite_command(impl, *pytest_args)
        env = records.suite_environment(results)
        quiet = {"stdout": subprocess.DEVNULL, "stderr": subprocess.STDOUT}
        returncode = subprocess.run(command, check=False, env=env, **quiet).returncode
        written = report.read_records(results)
        if not (cells := report.cells_from_records(written)):
            refusal = next((r["detail"] for r in written if "detail" in r), None)
            see = refusal or f"run {shlex.join(command)} to see its output"
            why = f"the run reported no check (pytest exit code {returncode})"
            return ImplResult(impl, unavailable=f"{why}: {see}")
    name = get_adapter(impl).name  # shown when it differs from `impl`
    return ImplResult(impl, "" if name == impl else name, [table_cell(cell) for cell in cells])


def _ref(notes: dict[str, int], reason: str) -> str:
    """`` [n]``, the number of ``reason`` among the numbered notes (each listed once)."""
    return f" [{notes.setdefault(reason, len(notes) + 1)}]" if reason else ""


def _cell_text(verdicts: list[tuple[str, str]], notes: dict[str, int]) -> str:
    """A table cell from (verdict, reason) per configuration."""
    by_verdict: dict[str, list[str]] = {}
    for verdict, reason in verdicts:
        by_verdict.setdefault(verdict, []).append(reason)
    parts = []
    for verdict in checks.VERDICTS:
        if not (reasons := by_verdict.get(verdict)):
            continue
        count = f" {len(reasons)}" if len(by_verdict) > 1 or len(verdicts) > 1 else ""
        refs = "" if verdict == "pass" else "".join(_ref(notes, r) for r in dict.fromkeys(reasons))
        parts.append(f"{verdict}{count}{refs}")
    return ", ".join(parts)


def render_table(results: Iterable[ImplResult], header: dict[str, str]) -> str:
    """docs/conformance.md: the check x implementation table, its notes and how it was made."""
    results = list(results)
    notes: dict[str, int] = {}  # reason -> its number
    per_impl: list[dict[str, list[tuple[str, str]]]] = []
    for result in results:
        grouped: dict[str, list[tuple[str, str]]] = {}
        for cell in result.cells:
            grouped.setdefault(cell.check, []).append((cell.verdict, cell.reason))
        per_impl.append(grouped)
    # check ids (and tests that are no registered check)
    rows = sorted({check for grouped in per_impl for check in grouped})
    rows.sort(key=lambda row: row not in checks.CHECKS)
    columns = [f"`{r.impl}`" + (f" ({r.adapter_name})" if r.adapter_name else "") for r in results]
    lines = [
        "# Conformance across implementations",
        "",
        "Generated by `fsdp-conformance conformance` -- do not edit by hand. Each cell folds the",
        "check's configurations: **pass**, **deviation** (a known deviation the adapter declares,",
        "with its reason), **not applicable** (the adapter lacks a feature the check needs, with",
        "the reason) or **FAIL**; a count follows when the configurations differ. Numbers in",
        "brackets are the notes under the table. Rows are the checks of the registry",
        "(`fsdp_conformance.checks`; deviations are declared under these ids, docs/adapters.md",
        '"Known deviations").',
        "",
        *(f"- {key}: {value}" for key, value in header.items()),
        "",
        "| check | promise | " + " | ".join(columns) + " |",
        "|---|---|" + "---|" * len(results),
    ]
    for check in rows:
        row = []
        for result, grouped in zip(results, per_impl, strict=True):
            if result.unavailable is not None:
                row.append("not applicable" + _ref(notes, result.unavailable))
            elif check in grouped:
                row.append(_cell_text(grouped[check], notes))
            else:
                row.append("not run")
        registered = checks.CHECKS.get(check)
        promise = _md(registered.description) if registered else "(not a registered check)"
        lines.append(f"| `{check}` | {promise} | " + " | ".join(row) + " |")
    if not rows:
        row = ["not applicable" + _ref(notes, r.unavailable or "no check ran") for r in results]
        lines.append("| (no check ran) | | " + " | ".join(row) + " |")
    lines += ["", "## Notes", ""]
    lines += [f"{number}. {_md(reason)}" for reason, number in notes.items()]
    return "\n".join(lines) + "\n"


def default_header(pytest_args: Sequence[str]) -> dict[str, str]:
    """Versions, date and the options of the run."""
    packages = ("torch", "fairscale", "deepspeed", "fsdp-conformance")
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "versions": ", ".join(f"{package} {package_version(package)}" for package in packages),
        "pytest arguments": " ".join(pytest_args) or "(none)",
    }


def generate(impls: Sequence[str], out: str, pytest_args: Sequence[str]) -> list[ImplResult]:
    """Run every implementation of ``impls`` and write the table to ``out``."""
    results = []
    for impl in impls:
        print(f"conformance: running the suite on {impl!r} ...", file=sys.stderr, flush=True)
        result = run_implementation(impl, pytest_args)
        status = result.unavailable or f"{len(result.cells)} cells"
        print(f"conformance: {impl!r}: {status}", file=sys.stderr, flush=True)
        results.append(result)
    text = render_table(results, default_header(pytest_args))
    with open(out, "w", encoding="utf-8") as stream:
        stream.write(text)
    return results
