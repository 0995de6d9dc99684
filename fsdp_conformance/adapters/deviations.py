"""Known deviations an adapter declares: checks its implementation fails on purpose, and why."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any


@dataclasses.dataclass(frozen=True)
class Deviation:
    """One documented deviation of an implementation from a check.

    Args:
        check: the stable dotted id of the check, e.g. ``"misuse.wrap_twice"``,
            ``"memory_bound"``, ``"exec_order.divergent"``, ``"parity.mixed_precision"``.
        reason: why, with a minimal reproduction.
        applies: a predicate on the check's case; None means every case of the check.
    """

    check: str
    reason: str
    applies: Callable[[Any], bool] | None = None
