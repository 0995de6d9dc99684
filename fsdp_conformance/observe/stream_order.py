"""Stream-ordered reuse of freed blocks, on the lagging device (the rule the residency model uses).

[Note: stream-ordered reuse]
A caching allocator hands a freed block at once to later work on the stream it was allocated on.
Another stream that used the block may still be using it, so the block is reusable only once
the device has passed an event recorded after that use: either the allocating stream waited on
such an event before the free (as torch FSDP2 orders it; ``reusable_at_free``), or, failing
that, once the event recorded at the free completes (``record_stream``: torch FSDP1, impl; the
residency tracker records a marker). ``OrderedStream`` (``LaggingDevice.ordered_stream``)
remembers the last event it was made to wait for.
"""

from __future__ import annotations

from typing import Any

from fsdp_conformance.observe.lagging import OrderedStream

__all__ = ["OrderedStream", "reusable_at_free"]


def reusable_at_free(stream: Any, used_after: int | None) -> bool:
    """Whether a block allocated on ``stream`` is reusable the moment the CPU frees it;
    ``used_after``: the device's last recorded sequence number when another stream last used
    the block (None: only ``stream`` used it)."""
    return used_after is None or getattr(stream, "waited", 0) > used_after
