"""How a check becomes a verdict in the rank (docs/architecture.md). ``cell`` decides it:

  not applicable  the adapter's support range or the check's features rule it out, or the body
                  raises UnsupportedFeatureError (a FAIL if the adapter claims the feature
                  but left its member at the base default)
  deviation       the failure is exactly what a declared ``Deviation`` covers
  FAIL            any other failure; a strict declared deviation that did not occur
  pass            otherwise

and records one ``checks.Result`` (report properties, through ``harness.properties``)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import pytest

from fsdp_conformance import checks
from fsdp_conformance.adapters import Adapter, UnsupportedFeatureError
from fsdp_conformance.adapters import deviations as adapter_deviations
from fsdp_conformance.adapters import features as adapter_features
from fsdp_conformance.adapters.base import claimed_but_not_implemented
from fsdp_conformance.harness import properties


def _record(result: checks.Result) -> None:
    for name, value in result.properties():
        properties.record_property(name, value)


def failure_line(error: BaseException) -> str:
    """``Type: first line`` of an error's message (a headline ending in ":" takes the next
    line too)."""
    message = getattr(error, "msg", None) or str(error)
    lines = [line.strip() for line in str(message).strip().splitlines() if line.strip()]
    if not lines:
        return type(error).__name__
    first = f"{lines[0]} {lines[1]}" if lines[0].endswith(":") and len(lines) > 1 else lines[0]
    return f"{type(error).__name__}: {first}"


def _not_applicable(check_id: str, reason: str, feature: str = "") -> None:
    _record(checks.Result(check_id, checks.NOT_APPLICABLE, reason, feature=feature))
    pytest.skip(reason)


@contextlib.contextmanager
def cell(adapter: Adapter, check_id: str, case: Any = None) -> Iterator[None]:
    """Run one cell of the registered check ``check_id`` for ``case`` (handed to
    ``Deviation.applies``); decide and record its verdict. ValueError for an unknown id."""
    check = checks.get_check(check_id)
    problem = adapter_features.support_problem(adapter)
    if problem is not None:
        _not_applicable(check_id, f"adapter {adapter.name!r}: {problem}", "version")
    try:
        adapter_features.require(adapter, *check.features)
    except UnsupportedFeatureError as error:
        _not_applicable(check_id, str(error), error.feature)
    deviation = adapter_deviations.find_deviation(adapter, check_id, case)
    try:
        yield
    except UnsupportedFeatureError as error:
        missing = claimed_but_not_implemented(adapter, error)
        if missing is None:
            _not_applicable(check_id, str(error), error.feature)
        _record(checks.Result(check_id, checks.FAIL, failure_line(missing)))
        raise missing from None
    except pytest.skip.Exception as error:
        _not_applicable(check_id, str(error.msg))
    except BaseException as error:
        if isinstance(error, (KeyboardInterrupt, SystemExit)):
            raise
        failure = failure_line(error)
        measured = error.as_json() if isinstance(error, checks.CheckFailure) else None
        covering = adapter_deviations.find_deviation(adapter, check_id, case, error)
        if covering is not None:
            reason = adapter_deviations.deviation_text(adapter, covering)
            _record(
                checks.Result(
                    check_id, checks.DEVIATION, reason, failure=failure, measured=measured
                )
            )
            pytest.xfail(
                f"{failure} -- known deviation of adapter {adapter.name!r} ({check_id}): {reason}"
            )
        why = ""
        if deviation is not None:
            why = (
                f" (outside the deviation adapter {adapter.name!r} declares for {check_id!r} "
                f"here: {deviation.outside_text(error)})"
            )
        _record(checks.Result(check_id, checks.FAIL, failure + why, measured=measured))
        if why and isinstance(error, Exception):
            error.add_note(why.strip())
        raise
    if deviation is not None and check.strict:
        message = (
            f"adapter {adapter.name!r} declares a known deviation for {check_id!r} on this case, "
            f"but the check passed: remove the Deviation (or narrow its applies). Declared "
            f"reason: {deviation.reason}"
        )
        _record(checks.Result(check_id, checks.FAIL, message))
        raise AssertionError(message)
    _record(checks.Result(check_id, checks.PASS))
