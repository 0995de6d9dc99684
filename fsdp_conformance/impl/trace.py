"""Observation hook: ``emit`` reports each communication/memory event just *before* it runs.

Ops: ``"all_gather"``, ``"all_gather_wait"``, ``"free"`` (``info["event"]`` is recorded right
after the free), ``"reduce_scatter"``, ``"all_reduce"``, ``"rate_limiter_wait"`` (``event``
waited on), ``"prefetch"`` (``target``, ``direction``: forward/backward_pre/backward_post).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

Observer = Callable[[str, Any, dict], None]

_observers: list[Observer] = []


def emit(op: str, instance: Any, **info: Any) -> None:
    """Report one event on ``instance`` (an FSDP instance) to every observer."""
    for callback in tuple(_observers):
        callback(op, instance, info)


@contextlib.contextmanager
def observe(callback: Observer) -> Iterator[Observer]:
    """Call ``callback(op, instance, info)`` for every event emitted inside the block."""
    _observers.append(callback)
    try:
        yield callback
    finally:
        _observers.remove(callback)
