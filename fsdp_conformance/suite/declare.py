"""``check``: declare a suite test as a check where it is written, and run it as one cell::

    @check("parity.ddp", "training matches DDP", case="configs.ParityCase", case_of="parity_case")
    def test_matches_ddp(self, fsdp_adapter, dist, parity_case): ...

registers the check in ``checks.CHECKS`` and runs the body in ``verdict.cell``."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Iterable
from typing import Any

from fsdp_conformance import checks

from . import verdict


def check(
    check_id: str,
    description: str = "",
    *,
    features: Iterable[str] = (),
    strict: bool = True,
    case: str = "",
    case_of: str | Callable[..., Any] | None = None,
    api: Iterable[str] = (),
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Declare the decorated test as (a test of) check `check_id`, run as one cell; the other
    arguments are the ``checks.Check`` fields (on a check's first test only; ``api``: the public
    FSDP API items it drives, suite/api_coverage.py). ``case_of``: the
    test argument naming the case for ``Deviation.applies``, or a function of test arguments
    returning it."""

    def decorate(function: Callable[..., Any]) -> Callable[..., Any]:
        signature = inspect.signature(function)
        case_from = _case_getter(case_of, signature, function.__qualname__)

        @functools.wraps(function)
        def run_cell(*args: Any, **kwargs: Any) -> Any:
            arguments = signature.bind(*args, **kwargs).arguments
            with verdict.cell(arguments["fsdp_adapter"], check_id, case_from(arguments)):
                return function(*args, **kwargs)

        if "fsdp_adapter" not in signature.parameters:
            raise TypeError(
                f"{function.__qualname__}: a check's test takes the fsdp_adapter fixture; add "
                "it to the test's parameters"
            )
        checks.declare(
            run_cell, check_id, description, features=features, strict=strict, case=case, api=api
        )
        return run_cell

    return decorate


def _case_getter(
    case_of: str | Callable[..., Any] | None, signature: inspect.Signature, test: str
) -> Callable[[dict[str, Any]], Any]:
    if case_of is None:
        return lambda arguments: None
    names = [case_of] if isinstance(case_of, str) else list(inspect.signature(case_of).parameters)
    unknown = [name for name in names if name not in signature.parameters]
    if unknown:
        raise TypeError(
            f"{test}: case_of names {unknown}, which the test does not take; name its arguments"
        )
    if isinstance(case_of, str):
        return lambda arguments: arguments[case_of]
    return lambda arguments: case_of(**{name: arguments[name] for name in names})


def calls(name: str, *forms: str) -> tuple[str, ...]:
    """The API items (suite/api_coverage.py) of method or function `name` called, ``name()``,
    and called with each of `forms` (``"recurse=False"``): ``check``'s `api`."""
    return (f"{name}()", *(f"{name}({form})" for form in forms))
