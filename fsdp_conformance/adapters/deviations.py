"""Known deviations: what an implementation does differently from a check, declared by its
adapter (``Declarations.known_deviations``); the cell then reports a deviation, not a failure.

[Note: envelopes]
A deviation covers only what was measured. A check's own failure (``checks.CheckFailure``)
carries its figure -- what failed and the measured values -- and a deviation of it declares an
``Envelope``: the same failure, and for each figure the measured value (a number: the worst
covered, within ``rtol``; anything else: exactly that value, or a ``re.Pattern`` it matches;
a figure not declared: zero, or empty).
Inside the envelope the cell is a deviation; a worse figure, another figure or another failure
is a FAIL naming both ("declared: ...; measured: ..."). An error of the implementation itself
(not a ``CheckFailure``) is covered by its exact signature: ``raises`` and ``match``. A deviation
stays with subclasses and with adapters that delegate (``delegates_to``). The verdict is decided
in ``fsdp_conformance/suite/verdict.py``.
"""

from __future__ import annotations

import dataclasses
import numbers
import re
import sys
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch

from fsdp_conformance.checks import CHECKS, CheckFailure, describe_figure, get_check

from .base import Adapter


@dataclasses.dataclass(frozen=True, init=False)
class Envelope:
    """What a deviation measured: the check's ``failure`` and its figures ([Note: envelopes]).

    ``Envelope("memory bound exceeded", peak=3)`` covers a peak of at most 3; ``rtol=0.5``
    widens every number by half of it (numerics that vary across releases).
    """

    failure: str
    figures: Mapping[str, Any]
    rtol: float

    def __init__(self, failure: str, *, rtol: float = 0.0, **figures: Any) -> None:
        if not isinstance(failure, str) or not failure:
            raise ValueError(f"Envelope({failure!r}): name the check's failure (a phrase)")
        if not isinstance(rtol, (int, float)) or rtol < 0:
            raise ValueError(f"Envelope({failure!r}): rtol={rtol!r} must be a number >= 0")
        for name, value in figures.items():
            if not isinstance(value, (numbers.Real, str, re.Pattern)):
                raise ValueError(  # noqa: TRY004 -- a bad declaration, as every check here
                    f"Envelope({failure!r}): figure {name}={value!r} must be a number (the worst "
                    "covered), a string (exactly that) or a re.compile() pattern (searched)"
                )
        object.__setattr__(self, "failure", failure)
        object.__setattr__(self, "figures", dict(figures))
        object.__setattr__(self, "rtol", float(rtol))

    def outside(self, error: CheckFailure) -> list[str]:
        """What of ``error``'s figure lies outside this envelope (empty: inside)."""
        if error.failure != self.failure:
            return [f"another failure ({error.failure!r})"]
        problems = [
            f"{name} not declared"
            for name, value in error.figures.items()
            if name not in self.figures and value not in (0, "")  # undeclared: zero, empty
        ]
        for name, declared in self.figures.items():
            if name not in error.figures:
                problems.append(f"{name} not measured")
            elif not self._within(declared, error.figures[name]):
                problems.append(f"{name} {error.figures[name]!r} beyond {declared!r}")
        return problems

    def _within(self, declared: Any, measured: Any) -> bool:
        if isinstance(declared, re.Pattern):
            return declared.search(str(measured)) is not None
        if isinstance(declared, numbers.Real) and not isinstance(declared, bool):
            return (
                isinstance(measured, numbers.Real)
                and not isinstance(measured, bool)
                and measured <= declared + abs(declared) * self.rtol
            )
        return measured == declared

    def __str__(self) -> str:
        return describe_figure(self.failure, dict(self.figures))


@dataclasses.dataclass(frozen=True)
class Deviation:
    """A check the implementation is known to fail, how it fails, and why.

    Args:
        check: the check id, one of ``fsdp_conformance.checks.CHECKS`` (e.g.
            ``"memory_bound"``).
        reason: why, with a minimal reproduction.
        applies: ``applies(case) -> bool``, the check's cases it covers; None: every case.
        envelope: the check's own failure it covers, as measured ([Note: envelopes]).
        raises: or the implementation's own error it covers: its exception type(s) ...
        match: ... and a regular expression searched in its message (both required).
        measured_on: where it was measured, e.g. ``"torch 2.13.0"``.
    """

    check: str
    reason: str
    applies: Callable[[Any], bool] | None = None
    envelope: Envelope | None = None
    raises: type[BaseException] | tuple[type[BaseException], ...] | None = None
    match: str | None = None
    measured_on: str = ""

    def __post_init__(self) -> None:
        def refuse(problem: str) -> None:
            raise ValueError(f"Deviation(check={self.check!r}): {problem}")

        if not isinstance(self.reason, str) or not self.reason.strip():
            refuse("give a non-empty reason (why, with a minimal reproduction)")
        if self.applies is not None and not callable(self.applies):
            refuse(f"applies={self.applies!r} must be None or a callable(case) -> bool")
        if self.envelope is not None:
            if not isinstance(self.envelope, Envelope):
                refuse(f"envelope={self.envelope!r} must be an Envelope(failure, **figures)")
            if self.raises is not None or self.match is not None:
                refuse(
                    "give an envelope (the check's failure) or raises and match (the "
                    "implementation's own error), not both"
                )
            return
        types = self._types
        if not types or not all(
            isinstance(t, type) and issubclass(t, BaseException) for t in types
        ):
            refuse(
                f"raises={self.raises!r}: declare envelope=Envelope(failure, **figures) for the "
                "check's own failure, or raises (exception types) and match for the "
                "implementation's own error"
            )
        try:
            re.compile(self.match)  # type: ignore[arg-type]
        except (re.error, TypeError) as error:
            refuse(
                f"match={self.match!r} must be the regular expression of the error's message "
                f"({error})"
            )

    @property
    def _types(self) -> tuple[type[BaseException], ...]:
        if self.raises is None:
            return ()
        return self.raises if isinstance(self.raises, tuple) else (self.raises,)

    def matches(self, check: str, case: Any = None) -> bool:
        """Whether this deviation covers ``check`` for ``case``."""
        return self.check == check and (self.applies is None or bool(self.applies(case)))

    def covers(self, error: BaseException) -> bool:
        """Whether ``error`` is the failure this deviation declares: a ``CheckFailure`` inside
        the envelope, or the implementation's error (type and message); an assertion raised
        *from* another error is that error's failure, so its cause must be covered too."""
        if isinstance(error, CheckFailure) or self.envelope is not None:
            return (
                self.envelope is not None
                and isinstance(error, CheckFailure)
                and not self.envelope.outside(error)
            )
        types = self._types
        if not self._is_type(error, types):
            return False
        cause = error.__cause__
        while cause is not None and self._is_assertion(cause):
            cause = cause.__cause__
        if error.__cause__ is not None and cause is not None and not self._is_type(cause, types):
            return False
        message = str(getattr(error, "msg", None) or error)
        return re.search(self.match or "", message, re.DOTALL) is not None

    @staticmethod
    def _is_assertion(error: BaseException) -> bool:
        return isinstance(error, AssertionError) or _is_pytest_failure(error)

    @classmethod
    def _is_type(cls, error: BaseException, types: tuple[type[BaseException], ...]) -> bool:
        return isinstance(error, types) or (AssertionError in types and _is_pytest_failure(error))

    def covers_text(self) -> str:
        """What it covers, in words."""
        if self.envelope is not None:
            return str(self.envelope)
        return " or ".join(t.__name__ for t in self._types) + f" matching {self.match!r}"

    def outside_text(self, error: BaseException) -> str:
        """``declared: ...; measured: ...``, for a failure this deviation does not cover."""
        if isinstance(error, CheckFailure):
            measured = error.measured()
            if self.envelope is not None:
                measured += f" -- {'; '.join(self.envelope.outside(error))}"
        else:
            lines = str(getattr(error, "msg", None) or error).strip().splitlines()
            measured = f"{type(error).__name__}: {lines[0] if lines else ''}"
        return f"declared: {self.covers_text()}; measured: {measured}"


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
