"""Which collective each rank entered last, so that failure reports name mismatched or missing
collectives instead of a torch-internal error or a hang. A listener of the collective observer
(``collective_observer.py``) records each collective on the default group (only those are
comparable across all ranks) into the rank's :class:`CollectiveSlot`, a memory-mapped file the
controller reads (processes) or a ``bytearray`` (threads): INSIDE from the call until the
collective ends (its ``Work`` completes: ``dist.all_reduce`` blocks in ``Work.wait``, after the
op returned), then LEFT, or RAISED when it failed.
"""

from __future__ import annotations

import dataclasses
import mmap
import struct
import threading
from collections.abc import Callable
from typing import Any

from fsdp_conformance import collective_observer

# count (collectives entered this test), state, operation name
_LAYOUT = struct.Struct("<IB31s")
SLOT_SIZE = _LAYOUT.size

# States of a record.
LEFT = 0  # returned from the collective (or none entered yet)
INSIDE = 1
RAISED = 2  # typically: another rank died, or the collectives did not match


@dataclasses.dataclass(frozen=True)
class CollectiveRecord:
    """The last collective a rank entered in the current test (``count`` 0: none)."""

    count: int
    state: int
    op: str

    @property
    def inside(self) -> bool:
        return self.state == INSIDE

    @property
    def raised(self) -> bool:
        return self.state == RAISED

    def where(self) -> str:
        return f"{self.op} (collective #{self.count})"

    def describe(self) -> str:
        """'in ...', 'failed in ...', 'last left ...' or 'entered no collective'."""
        if self.count == 0:
            return "entered no collective"
        where = self.where()
        if self.inside:
            return f"in {where}"
        return f"failed in {where}" if self.raised else f"last left {where}"


class CollectiveSlot:
    """One rank's record, in a buffer shared with whoever reads it."""

    def __init__(self, buffer: Any) -> None:
        self._buffer = buffer
        self._count = 0
        self._current: object | None = None  # the token of the collective last entered
        self._lock = threading.Lock()  # a collective may end on a backend's thread

    @classmethod
    def in_memory(cls) -> CollectiveSlot:
        return cls(bytearray(SLOT_SIZE))

    @classmethod
    def mapped(cls, path: str) -> CollectiveSlot:
        with open(path, "r+b") as stream:
            return cls(mmap.mmap(stream.fileno(), SLOT_SIZE))

    def reset(self) -> None:
        with self._lock:
            self._count = 0
            self._current = None
            self._write(LEFT, "")

    def read(self) -> CollectiveRecord:
        return _unpack(bytes(self._buffer[:SLOT_SIZE]))

    def _write(self, state: int, op: str) -> None:
        self._buffer[:SLOT_SIZE] = _LAYOUT.pack(self._count, state, op.encode("ascii")[:31])

    def enter(self, op: str) -> Callable[[BaseException | None], None]:
        """Record collective ``op`` entered; return the function that records it ended."""
        token = object()
        with self._lock:
            self._count += 1
            self._current = token
            self._write(INSIDE, op)

        def ended(error: BaseException | None) -> None:
            with self._lock:
                if self._current is token:  # else a later collective (or test) took the slot
                    self._write(LEFT if error is None else RAISED, op)

        return ended


def create_slot_file(path: str) -> None:
    with open(path, "wb") as stream:
        stream.write(bytes(SLOT_SIZE))


def read_slot_file(path: str) -> CollectiveRecord | None:
    """The record in ``path``, or None when the file is missing or short."""
    try:
        with open(path, "rb") as stream:
            data = stream.read(SLOT_SIZE)
    except OSError:
        return None
    return _unpack(data) if len(data) == SLOT_SIZE else None


def _unpack(data: bytes) -> CollectiveRecord:
    count, state, op = _LAYOUT.unpack(data)
    return CollectiveRecord(count, state, op.rstrip(b"\0").decode("ascii", "replace"))


# The slot of the current rank: one per process, or per rank thread in thread mode.
_local = threading.local()
_process_slot: CollectiveSlot | None = None


def set_process_slot(slot: CollectiveSlot | None) -> None:
    global _process_slot
    _process_slot = slot


def set_thread_slot(slot: CollectiveSlot | None) -> None:
    _local.slot = slot


def _current_slot() -> CollectiveSlot | None:
    return getattr(_local, "slot", None) or _process_slot


def _record(call: collective_observer.CollectiveCall) -> Callable[..., None] | None:
    """The harness's listener: records ``call`` into the calling rank's slot."""
    import torch.distributed.distributed_c10d as c10d

    slot = _current_slot()
    if slot is None or call.group is None or call.group is not c10d._world.default_pg:
        return None  # subgroups: not comparable across all ranks
    return slot.enter(call.op)


def install(python_group: type | None = None) -> Callable[[], None]:
    """Record the collectives of this process's ranks (``python_group``: a process group class
    written in Python whose methods are observed too, thread mode's); return the function that
    stops recording."""
    if python_group is not None:
        collective_observer.observe_python_group(python_group)
    return collective_observer.add_listener(_record)


def mismatch(records: dict[int, CollectiveRecord]) -> str:
    """'mismatched collectives: rank 0 entered all_reduce (collective #1), rank 1 entered
    all_gather (collective #1)' when ranks' last collectives of the same number differ, else
    ""."""
    by_count: dict[int, dict[int, CollectiveRecord]] = {}
    for rank, record in records.items():
        if record.count:
            by_count.setdefault(record.count, {})[rank] = record
    for count in sorted(by_count):
        group = by_count[count]
        if len({r.op for r in group.values()}) > 1:
            parts = ", ".join(f"rank {r} entered {group[r].where()}" for r in sorted(group))
            return f"mismatched collectives: {parts}"
    return ""


def unmatched(records: dict[int, CollectiveRecord], finished: set[int], rank: int) -> str:
    """Why ``rank`` waits in vain: 'rank 1 finished the test after 0 collective(s)' when ranks
    in ``finished`` ended without entering the collective ``rank`` is in (or raised in)."""
    if (mine := records.get(rank)) is None or mine.state == LEFT:
        return ""
    gone = sorted(r for r in finished if r in records and records[r].count < mine.count)
    return ", ".join(
        f"rank {r} finished the test after {records[r].count} collective(s)" for r in gone
    )
