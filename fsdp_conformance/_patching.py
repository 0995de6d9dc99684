"""The one way to patch an attribute of another library (torch, fairscale, DeepSpeed):
recorded with the library versions, idempotent per key, reversible, thread-safe;
``active_patches()`` lists what is patched in this process. Shared layer.
"""

from __future__ import annotations

import dataclasses
import sys
import threading
from collections.abc import Callable
from typing import Any

_lock = threading.RLock()
_records: dict[tuple[int, str, str], PatchRecord] = {}  # by (id(owner), attribute, key)


@dataclasses.dataclass
class PatchRecord:
    """One attribute replaced by `patch_attribute`."""

    owner: Any  # the module or class
    attribute: str
    key: str  # who patched it and why (e.g. "fsdp-conformance comm trace")
    # the value before; a class's own attribute as stored in its ``__dict__`` (a staticmethod
    # or a pybind11 method, which ``getattr`` would unwrap)
    original: Any
    replacement: Any
    written_for: str  # "<library> <version>" the patch was written against, "" if unsaid
    running: str  # "<library> <version>" running when it was installed

    @property
    def target(self) -> str:
        """``module.Class.attribute`` (or ``module.attribute``)."""
        owner = self.owner
        prefix = getattr(owner, "__module__", None)
        name = getattr(owner, "__qualname__", None) or getattr(owner, "__name__", repr(owner))
        if prefix and prefix != name:
            return f"{prefix}.{name}.{self.attribute}"
        return f"{name}.{self.attribute}"

    def undo(self) -> bool:
        """Restore the original; False (and nothing changed) when another patch replaced ours
        since, or it was undone already."""
        with _lock:
            key = (id(self.owner), self.attribute, self.key)
            if _records.get(key) is not self:
                return False
            stored = getattr(self.owner, "__dict__", {}).get(self.attribute, _MISSING)
            live = getattr(self.owner, self.attribute, _MISSING)
            if self.replacement is not stored and self.replacement is not live:
                return False
            setattr(self.owner, self.attribute, self.original)
            del _records[key]
            return True

    def __str__(self) -> str:
        written = f", written for {self.written_for}" if self.written_for else ""
        return f"{self.target} patched by {self.key!r}{written}, running {self.running}"


_MISSING = object()


def library_version(library: str) -> str:
    """``"<library> <version>"`` of an imported library (``"<library> (not imported)"``)."""
    module = sys.modules.get(library)
    version = getattr(module, "__version__", None) if module is not None else None
    if module is None:
        return f"{library} (not imported)"
    return f"{library} {version}" if version else library


def patch_attribute(
    owner: Any,
    attribute: str,
    make: Callable[[Any], Any],
    *,
    key: str,
    written_for: str = "",
    library: str = "torch",
) -> PatchRecord:
    """Replace ``owner.attribute`` with ``make(original)`` (called once, under the lock), once
    per (owner, attribute, key): a second call with `key` returns the first record.
    `written_for` is the version of `library` the patch was verified against.

    Raises:
        AttributeError: ``owner`` has no ``attribute`` (the library's internals moved), naming
            the versions running and written for.
    """
    if not isinstance(key, str) or not key:
        raise ValueError(f"patch_attribute({attribute!r}): give a non-empty key naming the patcher")
    with _lock:
        record_key = (id(owner), attribute, key)
        if (record := _records.get(record_key)) is not None:
            return record
        if (original := getattr(owner, attribute, _MISSING)) is _MISSING:
            name = getattr(owner, "__qualname__", None) or getattr(owner, "__name__", repr(owner))
            written = f" (written for {written_for})" if written_for else ""
            raise AttributeError(
                f"{name} has no attribute {attribute!r} under {library_version(library)}: the "
                f"internals {key!r} patches moved{written}; use a supported version"
            )
        replacement = make(original)
        if isinstance(owner, type) and attribute in vars(owner):
            original = vars(owner)[attribute]  # what undo puts back, binding as before
        setattr(owner, attribute, replacement)
        running = library_version(library)
        record = PatchRecord(owner, attribute, key, original, replacement, written_for, running)
        _records[record_key] = record
        return record


def active_patches() -> list[PatchRecord]:
    """The patches installed in this process, oldest first."""
    with _lock:
        return list(_records.values())


def undo_all(key: str | None = None) -> int:
    """Undo every patch (or those with ``key``), newest first; the number undone."""
    with _lock:
        records = [r for r in reversed(list(_records.values())) if key is None or r.key == key]
        return sum(record.undo() for record in records)
