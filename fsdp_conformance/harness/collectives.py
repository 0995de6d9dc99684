"""Which collective each rank entered last, so that failure reports name mismatched or missing
collectives instead of a torch-internal error or a hang. The ``torch.distributed`` collectives
on the default group are wrapped (nested calls record the outermost); each rank writes its
:class:`CollectiveSlot`: a memory-mapped file the controller reads (processes), or a
``bytearray`` (threads).
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import mmap
import struct
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from fsdp_conformance import constants
from fsdp_conformance._patching import patch_attribute

# Collectives of torch.distributed that are recorded (send / recv are not)
COLLECTIVES = constants.TORCH_COLLECTIVES
_KEY = "fsdp-conformance collective records"

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
        self._depth = 0
        self._count = 0

    @classmethod
    def in_memory(cls) -> CollectiveSlot:
        return cls(bytearray(SLOT_SIZE))

    @classmethod
    def mapped(cls, path: str) -> CollectiveSlot:
        with open(path, "r+b") as stream:
            return cls(mmap.mmap(stream.fileno(), SLOT_SIZE))

    def reset(self) -> None:
        self._depth = 0
        self._count = 0
        self._write(LEFT, "")

    def read(self) -> CollectiveRecord:
        return _unpack(bytes(self._buffer[:SLOT_SIZE]))

    def _write(self, state: int, op: str) -> None:
        self._buffer[:SLOT_SIZE] = _LAYOUT.pack(self._count, state, op.encode("ascii")[:31])

    @contextmanager
    def entered(self, op: str) -> Iterator[None]:
        self._depth += 1
        if self._depth == 1:
            self._count += 1
            self._write(INSIDE, op)
        state = RAISED
        try:
            yield
            state = LEFT
        finally:
            self._depth -= 1
            if self._depth == 0:
                self._write(state, op)


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


def _wrap(name: str, function: Callable[..., Any], c10d: Any) -> Callable[..., Any]:
    """``function`` (the collective ``name``) recording into the calling rank's slot."""
    try:
        parameters = list(inspect.signature(function).parameters)
    except (TypeError, ValueError):
        parameters = []
    group_index = parameters.index("group") if "group" in parameters else None

    @functools.wraps(function)
    def recorded(*args: Any, **kwargs: Any) -> Any:
        slot = _current_slot()
        if slot is None:
            return function(*args, **kwargs)
        group = kwargs.get("group")
        if group is None and group_index is not None and group_index < len(args):
            group = args[group_index]
        if group is not None and group is not c10d._world.default_pg:
            return function(*args, **kwargs)  # subgroups: not comparable across all ranks
        with slot.entered(name):
            return function(*args, **kwargs)

    return recorded


def install() -> Callable[[], None]:
    """Wrap the collectives of ``torch.distributed`` (once: a second call wraps nothing more);
    return a function that unwraps them."""
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    records = [
        patch_attribute(
            module,
            name,
            functools.partial(_wrap, name, c10d=c10d),
            key=_KEY,
            written_for="torch 2.13.0",
        )
        for name in COLLECTIVES
        for module in (dist, c10d)
        if hasattr(module, name)
    ]

    def uninstall() -> None:
        for record in records:
            record.undo()

    return uninstall


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
            parts = ", ".join(
                f"rank {rank} entered {group[rank].where()}" for rank in sorted(group)
            )
            return f"mismatched collectives: {parts}"
    return ""


def unmatched(records: dict[int, CollectiveRecord], finished: set[int], rank: int) -> str:
    """Why ``rank`` waits in vain: 'rank 1 finished the test after 0 collective(s)' when ranks
    in ``finished`` ended without entering the collective ``rank`` is in (or raised in)."""
    mine = records.get(rank)
    if mine is None or mine.state == LEFT:
        return ""
    gone = sorted(r for r in finished if r in records and records[r].count < mine.count)
    return ", ".join(
        f"rank {r} finished the test after {records[r].count} collective(s)" for r in gone
    )
