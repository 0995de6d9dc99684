"""Known deviations: what an implementation does differently from a check, declared by its
adapter (``Declarations.known_deviations``); the cell then reports a deviation, not a failure.

A deviation covers one failure (``raises`` and ``match``): any other error in that cell is a
failure. It stays with subclasses and with adapters that delegate (``delegates_to``). The
verdict is decided in ``fsdp_conformance/suite/verdict.py``.
"""

from __future__ import annotations

import dataclasses
import re
import sys
from collections.abc import Callable, Iterable
from typing import Any

import torch

from fsdp_conformance.checks import CHECKS, get_check

from .base import Adapter


@dataclasses.dataclass(frozen=True)
class Deviation:
    """A check the implementation is known to fail, how it fails, and why.

    Args:
        check: the check id, one of ``fsdp_conformance.checks.CHECKS`` (e.g.
            ``"misuse.wrap_twice"``).
        reason: why, with a minimal reproduction.
        applies: ``applies(case) -> bool``, the check's cases it covers; None: every case.
        raises: the exception type(s) it covers (``AssertionError``: the check's own assertion,
            ``pytest.fail`` and a failed ``pytest.raises`` too).
        match: a regular expression searched in the failure's message; None: any message.
        measured_on: where it was measured, e.g. ``"torch 2.13.0"``.
    """

    check: str
    reason: str
    applies: Callable[[Any], bool] | None = None
    raises: type[BaseException] | tuple[type[BaseException], ...] = AssertionError
    match: str | None = None
    measured_on: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.reason, str) or not self.reason.strip():
            raise ValueError(
                f"Deviation(check={self.check!r}): give a non-empty reason (why, with a minimal "
                "reproduction)"
            )
        if self.applies is not None and not callable(self.applies):
            raise ValueError(
                f"Deviation(check={self.check!r}): applies={self.applies!r} must be None or a "
                "callable(case) -> bool"
            )
        types = self._types
        if not types or not all(
            isinstance(t, type) and issubclass(t, BaseException) for t in types
        ):
            raise ValueError(
                f"Deviation(check={self.check!r}): raises={self.raises!r} must be an exception "
                "type or a tuple of them (the failure the deviation covers)"
            )
        if self.match is not None:
            try:
                re.compile(self.match)
            except (re.error, TypeError) as error:
                raise ValueError(
                    f"Deviation(check={self.check!r}): match={self.match!r} is not a regular "
                    f"expression ({error})"
                ) from None

    @property
    def _types(self) -> tuple[type[BaseException], ...]:
        return self.raises if isinstance(self.raises, tuple) else (self.raises,)

    def matches(self, check: str, case: Any = None) -> bool:
        """Whether this deviation covers ``check`` for ``case``."""
        return self.check == check and (self.applies is None or bool(self.applies(case)))

    def covers(self, error: BaseException) -> bool:
        """Whether ``error`` is the failure this deviation declares (type and message); an
        assertion raised *from* another error is that error's failure, so its cause must be
        covered too."""
        types = self._types
        if not self._is_type(error, types):
            return False
        cause = error.__cause__
        while cause is not None and self._is_assertion(cause):
            cause = cause.__cause__
        if error.__cause__ is not None and cause is not None and not self._is_type(cause, types):
            return False
        if self.match is None:
            return True
        message = str(getattr(error, "msg", None) or error)
        return re.search(self.match, message, re.DOTALL) is not None

    @staticmethod
    def _is_assertion(error: BaseException) -> bool:
        return isinstance(error, AssertionError) or _is_pytest_failure(error)

    @classmethod
    def _is_type(cls, error: BaseException, types: tuple[type[BaseException], ...]) -> bool:
        return isinstance(error, types) or (AssertionError in types and _is_pytest_failure(error))

    def covers_text(self) -> str:
        """What it covers, in words."""
        names = " or ".join(t.__name__ for t in self._types)
        return names + (f" matching {self.match!r}" if self.match else "")


def _is_pytest_failure(error: BaseException) -> bool:
    """``pytest.fail`` / a failed ``pytest.raises``."""
    failed = getattr(sys.modules.get("_pytest.outcomes"), "Failed", None)
    return failed is not None and isinstance(error, failed)


def first_covering(
    deviations: Iterable[Deviation],
    check: str,
    case: Any = None,
    error: BaseException | None = None,
) -> Deviation | None:
    """The first of ``deviations`` covering ``check`` / ``case`` (and ``error``), or None;
    ValueError when ``check`` or a deviation's check is not a registered id."""
    get_check(check)
    deviations = tuple(deviations)
    for deviation in deviations:
        if not isinstance(deviation, Deviation):
            raise TypeError(
                f"known_deviations holds {deviation!r}, not a Deviation; declare "
                "Deviation(check, reason, applies) entries"
            )
        if deviation.check not in CHECKS:
            raise ValueError(
                f"Deviation(check={deviation.check!r}): unknown check id; use one of "
                f"{', '.join(sorted(CHECKS))}"
            )
    for deviation in deviations:
        if deviation.matches(check, case) and (error is None or deviation.covers(error)):
            return deviation
    return None


def delegation_chain(adapter: Any) -> list[Any]:
    """``adapter``, then the adapters along ``delegates_to`` (each once); TypeError when one
    is not an Adapter."""
    chain = [adapter]
    delegate = adapter.declarations.delegates_to
    while delegate is not None and all(delegate is not seen for seen in chain):
        if not isinstance(delegate, Adapter):
            raise TypeError(
                f"adapter {adapter.name!r}: delegates_to is {delegate!r}, not an Adapter; set it "
                "to the adapter instance this one wraps (or None)"
            )
        chain.append(delegate)
        delegate = delegate.declarations.delegates_to
    return chain


def find_deviation(
    adapter: Any, check: str, case: Any = None, error: BaseException | None = None
) -> Deviation | None:
    """The deviation ``adapter`` declares (along ``delegation_chain``) that covers ``check`` /
    ``case`` and, given ``error``, that failure; or None. ValueError for an unknown check id."""
    if isinstance(adapter, (tuple, list)):  # the deviations themselves
        return first_covering(adapter, check, case, error)
    for link in delegation_chain(adapter):
        deviation = first_covering(link.declarations.known_deviations, check, case, error)
        if deviation is not None:
            return deviation
    return None


def deviation_reason(adapter: Any, check: str, case: Any = None) -> str | None:
    """The reason of the deviation ``adapter`` declares for ``check`` / ``case``, or None."""
    deviation = find_deviation(adapter, check, case)
    return None if deviation is None else deviation.reason


def running_versions(adapter: Any) -> str:
    """The versions of what ``adapter`` drives, e.g. ``"torch 2.13.0"``."""
    return f"torch {torch.__version__}"


def deviation_text(adapter: Any, deviation: Deviation) -> str:
    """``deviation``'s reason with where it was measured and what runs now."""
    measured = f"measured on {deviation.measured_on}; " if deviation.measured_on else ""
    return f"{deviation.reason} ({measured}running {running_versions(adapter)})"
