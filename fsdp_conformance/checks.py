"""The check registry: every check of the conformance suite, and the verdict record of a cell.

A *check* is one promise an FSDP implementation makes: its dotted id, description, the suite
tests implementing it, the adapter features it needs and whether a declared deviation must
occur. Importing ``fsdp_conformance.suite`` fills ``CHECKS`` (``fsdp_conformance.suite.check``
calls ``declare``). A *cell* (one test, one configuration) gets one of ``VERDICTS``, recorded
on its pytest report as the properties ``PROPERTY_*``. Shared layer: no torch, no project import.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shlex
from collections.abc import Callable, Iterable, Sequence
from typing import Any

PASS = "pass"
DEVIATION = "deviation"  # failed as the adapter declared (a known deviation)
NOT_APPLICABLE = "not applicable"  # the adapter lacks a feature the check needs (a skip)
FAIL = "FAIL"
VERDICTS = (FAIL, DEVIATION, PASS, NOT_APPLICABLE)  # the order a mixed cell lists them

# pytest report properties (``report.user_properties``, JUnit ``<property>``) of a cell
PROPERTY_CHECK = "fsdp_check"
PROPERTY_VERDICT = "fsdp_verdict"
PROPERTY_REASON = "fsdp_reason"  # deviation reason / missing feature / failure, one line
PROPERTY_FEATURE = "fsdp_feature"  # the missing feature of a not-applicable cell
PROPERTY_FAILURE = "fsdp_failure"  # what failed in a deviating cell (the declared failure)
PROPERTY_RERUN = "fsdp_rerun"  # the shell line re-running a failing or deviating cell alone
PROPERTY_DEVICE = "fsdp_device"  # where the cell's ranks ran: "cuda:0 shared by 2 ranks (gloo)"
PROPERTY_MEASURED = "fsdp_measured"  # a failing or deviating cell's CheckFailure, as JSON


class CheckFailure(AssertionError):
    """A check's own failure with what it measured, the figure a declared deviation's envelope
    is compared with (``adapters.deviations.Envelope``) -- never parsed back from the message.

    Args:
        message: what failed, for a reader.
        failure: what kind of failure, a fixed phrase (e.g. ``"memory bound exceeded"``).
        **figures: the measured values. A number grows as the failure worsens (a peak, a gap, a
            shortfall); any other value (a dtype's name, a state, a hook, counts) is what was
            seen.
    """

    def __init__(self, message: str, failure: str, **figures: Any) -> None:
        super().__init__(message)
        self.failure = failure
        self.figures = figures

    def __reduce__(self) -> tuple[Any, ...]:  # pickled with its figure (keywords)
        return _check_failure, (str(self), self.failure, self.figures)

    def measured(self) -> str:
        """``failure (name value, ...)``: the measured figure in words."""
        return describe_figure(self.failure, self.figures)

    def as_json(self) -> str:
        """The figure as one line of JSON (``PROPERTY_MEASURED``)."""
        return json.dumps({"failure": self.failure, **self.figures}, default=str, sort_keys=True)


def _check_failure(message: str, failure: str, figures: dict[str, Any]) -> CheckFailure:
    return CheckFailure(message, failure, **figures)


def describe_figure(failure: str, figures: dict[str, Any]) -> str:
    """``failure (name value, ...)``."""
    values = ", ".join(f"{name} {_figure_text(value)}" for name, value in figures.items())
    return f"{failure} ({values})" if values else failure


def _figure_text(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.3g}"
    return getattr(value, "pattern", None) or str(value)


@dataclasses.dataclass(frozen=True)
class Check:
    """One check of the suite."""

    id: str  # dotted, e.g. "parity.ddp" (what Deviation.check names)
    description: str  # one line: the promise checked
    tests: tuple[str, ...]  # the suite tests implementing it, "BaseClass.test_method"
    features: tuple[str, ...] = ()  # adapter features every cell of it needs
    # whether a declared deviation must occur (a passing cell then fails: remove the
    # declaration); False where conforming after all is fine (a misuse refused anyway)
    strict: bool = True
    case: str = ""  # what the `case` handed to Deviation.applies is ("" for none)
    # the public FSDP API items it drives (suite/api_coverage.py, docs/api_coverage.md)
    api: tuple[str, ...] = ()


# check id -> Check, in declaration order (import fsdp_conformance.suite for all of them)
CHECKS: dict[str, Check] = {}
_CHECK_ATTRIBUTE = "fsdp_check_id"  # set on a declared test function


def declare(
    function: Callable[..., Any],
    check_id: str,
    description: str = "",
    *,
    features: Iterable[str] = (),
    strict: bool = True,
    case: str = "",
    api: Iterable[str] = (),
) -> Check:
    """Record that `function` (a suite test) implements `check_id`. The first declaration of an
    id gives its description and options; the check's other tests name only its id.

    Raises:
        ValueError: a second declaration of an id differs from the first, or a declaration
            without a description names an id not declared before.
    """
    test = function.__qualname__
    known = CHECKS.get(check_id)
    first = Check(check_id, description, (test,), tuple(features), strict, case, tuple(api))
    if description:
        if known is not None and dataclasses.replace(known, tests=(test,)) != first:
            raise ValueError(
                f"check {check_id!r} is declared twice, differently ({known.tests[0]} and "
                f"{test}); give the description and options on its first test only"
            )
    elif known is None:
        raise ValueError(
            f"check {check_id!r} (on {test}) is not declared yet; give its description (and "
            "options) on the check's first test"
        )
    elif features or not strict or case or api:
        raise ValueError(
            f"check {check_id!r} (on {test}): options belong to its first declaration "
            f"({known.tests[0]}); name only the id here"
        )
    declared = first if known is None else known
    if test not in declared.tests:
        declared = dataclasses.replace(declared, tests=(*declared.tests, test))
    CHECKS[check_id] = declared
    setattr(function, _CHECK_ATTRIBUTE, check_id)
    return declared


def check_of(function: Any) -> Check | None:
    """The check a suite test function was declared for, or None."""
    check_id = getattr(function, _CHECK_ATTRIBUTE, None)
    return CHECKS.get(check_id) if isinstance(check_id, str) else None


def get_check(check_id: str) -> Check:
    """The registered check `check_id`; ValueError listing the known ids if there is none."""
    try:
        return CHECKS[check_id]
    except (KeyError, TypeError):
        if not CHECKS:
            raise ValueError(
                f"unknown check id {check_id!r}: no check is registered yet; import "
                "fsdp_conformance.suite first (it registers every check)"
            ) from None
        raise ValueError(
            f"unknown check id {check_id!r}; use one of {', '.join(sorted(CHECKS))} "
            "(fsdp_conformance.checks.CHECKS)"
        ) from None


def check_for_test(class_names: Iterable[str], function_name: str) -> Check | None:
    """The check of test `function_name` of a class whose MRO holds one of `class_names`."""
    names = set(class_names)
    for check in CHECKS.values():
        for test in check.tests:
            class_name, _, method = test.rpartition(".")
            if method == function_name and class_name in names:
                return check
    return None


def verdict_of_outcome(
    outcome: str, expected_failure: bool, recorded: dict[str, str], text: str
) -> tuple[str, str]:
    """(verdict, reason) of a cell from pytest's `outcome` ("passed", "failed", "skipped") and
    `expected_failure` (``wasxfail``). The `recorded` ``PROPERTY_*`` reason is kept where its
    verdict agrees; otherwise (a rank failed on its own, a hang) the outcome decides, with
    `text` (one line of the failure or skip) as the reason.
    """
    if outcome == "failed":
        verdict = FAIL
    elif outcome == "skipped":
        verdict = DEVIATION if expected_failure else NOT_APPLICABLE
    elif expected_failure:  # an xfail marker that passed: we never set one, so it is a defect
        return FAIL, f"unexpectedly passed: {text}"
    else:
        verdict = PASS
    if recorded.get(PROPERTY_VERDICT) == verdict:
        return verdict, recorded.get(PROPERTY_REASON, "")
    return verdict, "" if verdict == PASS else _one_line(text)


def _one_line(text: str) -> str:
    return " ".join(str(text).split())


@dataclasses.dataclass(frozen=True)
class Result:
    """The verdict of one cell, decided by its check in a rank (suite/verdict.py) or, for a
    cell that never reached its check, from pytest's outcome; carried as ``PROPERTY_*``."""

    check: str  # "" when the test is no registered check
    verdict: str  # one of VERDICTS
    reason: str = ""  # deviation reason, why not applicable, what failed ("" for a pass)
    failure: str | None = None  # PROPERTY_FAILURE (None: not recorded)
    feature: str | None = None  # PROPERTY_FEATURE (None: not recorded)
    rerun: str | None = None  # PROPERTY_RERUN (None: not recorded)
    measured: str | None = None  # PROPERTY_MEASURED (None: not recorded)

    def properties(self) -> list[tuple[str, str]]:
        """The record as report properties, each value on one line."""
        recorded = [
            (PROPERTY_CHECK, self.check),
            (PROPERTY_VERDICT, self.verdict),
            (PROPERTY_REASON, _one_line(self.reason)),
            (PROPERTY_FEATURE, self.feature and _one_line(self.feature)),
            (PROPERTY_FAILURE, self.failure and _one_line(self.failure)),
            (PROPERTY_RERUN, self.rerun),
            (PROPERTY_MEASURED, self.measured),
        ]
        return [(name, value) for name, value in recorded if value is not None]

    @classmethod
    def from_properties(cls, properties: Iterable[tuple[str, object]]) -> Result | None:
        """The record among report properties (the last value of each wins), or None."""
        values = {name: str(value) for name, value in properties}
        if PROPERTY_VERDICT not in values:
            return None
        check, reason = values.get(PROPERTY_CHECK, ""), values.get(PROPERTY_REASON, "")
        # None: not recorded
        optional = (PROPERTY_FAILURE, PROPERTY_FEATURE, PROPERTY_RERUN, PROPERTY_MEASURED)
        return cls(check, values[PROPERTY_VERDICT], reason, *map(values.get, optional))

    @classmethod
    def of_report(cls, check: str, report: object, recorded: Result | None = None) -> Result:
        """The record of a pytest ``TestReport`` or ``CollectReport``: `recorded` when the
        outcome agrees with it, else the verdict the outcome implies (``verdict_of_outcome``)."""
        outcome = str(getattr(report, "outcome", "failed"))
        expected_failure = hasattr(report, "wasxfail")
        kept = dict(recorded.properties()) if recorded is not None else {}
        verdict, reason = verdict_of_outcome(outcome, expected_failure, kept, report_line(report))
        if recorded is not None and recorded.verdict == verdict:
            return recorded
        return cls(check, verdict, reason)

    @property
    def outcome(self) -> str:
        """The CLI's outcome of the cell: pass, fail, xfail or skip."""
        return _OUTCOME_OF_VERDICT[self.verdict]


_OUTCOME_OF_VERDICT = {PASS: "pass", FAIL: "fail", DEVIATION: "xfail", NOT_APPLICABLE: "skip"}


def shell_line(impl: str, words: Sequence[str]) -> str:
    """``words`` as one shell line that works pasted in any fresh shell: it carries the
    ``PYTHONPATH`` this run had (absolute), and for a ``pkg.mod:ATTR`` adapter (imported from
    the current directory) it starts with ``cd <this directory> &&``."""
    line = shlex.join(words)
    entries = [entry for entry in os.environ.get("PYTHONPATH", "").split(os.pathsep) if entry]
    if entries:
        path = os.pathsep.join(os.path.abspath(entry) for entry in entries)
        line = f"PYTHONPATH={shlex.quote(path)} {line}"
    return f"cd {shlex.quote(os.getcwd())} && {line}" if ":" in impl else line


def report_line(report: object) -> str:
    """One line of a pytest report's skip reason, xfail reason or crash message."""
    longrepr = getattr(report, "longrepr", None)
    if isinstance(longrepr, tuple) and len(longrepr) == 3:  # a skip: (file, line, reason)
        return str(longrepr[2]).removeprefix("Skipped: ")
    wasxfail = str(getattr(report, "wasxfail", "")).removeprefix("reason: ")
    crash = getattr(longrepr, "reprcrash", None)
    text = wasxfail or (crash.message if crash is not None else str(longrepr or ""))
    lines = [line.strip() for line in str(text).strip().splitlines() if line.strip()]
    return lines[0] if lines else ""


def registry_table() -> str:
    """The registry as a Markdown table (docs/checks.md holds it, checked by a test)."""
    lines = [
        "| check id | promise | tests | needs | strict | case (`Deviation.applies`) |",
        "|---|---|---|---|---|---|",
    ]
    for check in CHECKS.values():
        tests = "<br>".join(f"`{test}`" for test in check.tests)
        needs = ", ".join(f"`{feature}`" for feature in check.features) or "—"
        strict = "yes" if check.strict else "no"
        lines.append(
            f"| `{check.id}` | {check.description} | {tests} | {needs} | {strict} "
            f"| {check.case or 'None'} |"
        )
    return "\n".join(lines)
