"""Observation hook: one ``emit`` call per communication/memory event.

Every event is emitted just *before* its operation. Ops (``op`` argument): ``"all_gather"``
(issue), ``"all_gather_wait"``, ``"free"`` (of an all-gathered buffer; ``info["event"]`` is its
free event, recorded right after the free, i.e. after the callbacks return), ``"reduce_scatter"``,
``"all_reduce"``, ``"rate_limiter_wait"`` (``info["event"]`` is the event waited on),
``"prefetch"`` (``info["target"]``: the instance prefetched, ``info["direction"]``:
``"forward"``, ``"backward_pre"`` or ``"backward_post"``).

``emit`` is a no-op while nobody observes.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

Observer = Callable[[str, Any, dict], None]

# registered callbacks, called in registration order
_observers: list[Observer] = []


def emit(op: str, instance: Any, **info: Any) -> None:
    """Report one event on ``instance`` (an FSDP instance) to every observer."""
    if not _observers:
        return
    for callback in tuple(_observers):
        callback(op, instance, info)


@contextlib.contextmanager
def observe(callback: Observer) -> Iterator[Observer]:
    """Call ``callback(op, instance, info)`` for every event emitted inside the block.

    Args:
        callback: receives the op name, the FSDP instance and a dict of details.
    """
    _observers.append(callback)
    try:
        yield callback
    finally:
        _observers.remove(callback)
