"""``record_property(name, value)``: pytest's ``record_property`` for code running in ranks.

What a body records travels back with the rank's outcome (``collecting()`` runs around every
body) and ends in ``item.user_properties``; values must be picklable. What is recorded outside
a body waits for ``take_pending()``.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

_local = threading.local()
_pending: list[tuple[str, Any]] = []
_pending_lock = threading.Lock()


def record_property(name: str, value: Any) -> None:
    """Record ``name = value`` for the running test."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"record_property: name {name!r} must be a non-empty string")
    stack: list[list[tuple[str, Any]]] | None = getattr(_local, "stack", None)
    if stack:
        stack[-1].append((name, value))
        return
    with _pending_lock:
        _pending.append((name, value))


@contextlib.contextmanager
def collecting() -> Iterator[list[tuple[str, Any]]]:
    """Collect what this thread records while the block runs."""
    stack = _local.__dict__.setdefault("stack", [])
    recorded: list[tuple[str, Any]] = []
    stack.append(recorded)
    try:
        yield recorded
    finally:
        stack.pop()


def take_pending() -> list[tuple[str, Any]]:
    """What was recorded outside any body since the last call (and forget it)."""
    with _pending_lock:
        taken = list(_pending)
        _pending.clear()
    return taken
