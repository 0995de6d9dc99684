"""Stream-ordered reuse of freed blocks, on the lagging device (the rule the residency model uses).

[Note: stream-ordered reuse]
A caching allocator hands a freed block to later work on the stream the block was allocated on
at once -- that work runs after the free in stream order. Any *other* stream that used the block
may still be using it on the device, so the block is reusable only once the device has passed
an event recorded after that use: either the allocating stream has waited on such an event
before the free (the implementation ordered the reuse, as torch FSDP2 does when its all-gather
streams wait on the copy-out event before dropping the all-gather output), or, failing that,
once the device completes the event recorded at the free (``record_stream``: torch FSDP1 and the
reference FSDP, whose unsharded buffer is allocated on the unshard stream and used by the
compute stream). ``reusable_at_free`` decides the first case; the residency tracker records a
marker at the free for the second.

``OrderedStream`` (defined beside the lagging device, ``LaggingDevice.ordered_stream``) is a
stream of a ``LaggingDevice`` that remembers the last event it was made
to wait for (``waited``, a sequence number of the device); waiting orders, it completes nothing.
"""

from __future__ import annotations

from typing import Any

from fsdp_conformance.observe.lagging import OrderedStream

__all__ = ["OrderedStream", "reusable_at_free"]


def reusable_at_free(stream: Any, used_after: int | None) -> bool:
    """Whether a block allocated on ``stream`` is reusable the moment the CPU frees it.

    Args:
        stream: the stream the block was allocated on.
        used_after: the device's last recorded sequence number when another stream last used
            the block, or None when only ``stream`` used it.
    """
    if used_after is None:
        return True
    return getattr(stream, "waited", 0) > used_after
