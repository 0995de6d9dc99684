"""The all-gather rate limiter: a queue of free events (see [Note: residency bound]).

[Note: residency bound]
An unsharded buffer is *resident* from its all-gather issue until the event recorded
right after its free has completed on the device. The limiter keeps

    resident non-root buffers <= MAX_INFLIGHT (+1 for an early prefetch)

at every all-gather issue: before issuing, while (free events not known complete) +
(non-root buffers currently unsharded) + 1 exceeds the allowance, the oldest free event
is dequeued and the CPU blocks on it. Events complete in order, so synchronizing the
oldest completes nothing newer and over-waiting never happens. An *early* prefetch is
one issued while the issuing non-root instance still holds its own buffer
(``forward_prefetch`` in pre-forward, ``BACKWARD_PRE`` in pre-backward); it may use one
extra slot. Counting live buffers as well as pending frees is what torch FSDP1 lacks:
its queue only counts frees, so an unshard skipped for an already-prefetched handle
lets a third buffer in.

Exactly two call sites (``runtime.py``): ``enqueue`` right after the free at reshard,
``dequeue_if_needed`` (+ synchronize inside the profiler range
``FullyShardedDataParallel.rate_limiter``) before issuing an all-gather.
"""

from __future__ import annotations

import collections
from collections.abc import Callable
from typing import Any

from fsdp_conformance import constants

# Two buffers: the instance computing now and the one whose all-gather is in flight
# (the FSDP1 rate limiter's empirically chosen depth).
MAX_INFLIGHT = constants.MAX_INFLIGHT


class FreeEventQueue:
    """Free events of resharded buffers, oldest first, shared by one root's instances."""

    def __init__(self, live_buffers: Callable[[], int]) -> None:
        # events recorded right after each free, not yet synchronized by the limiter
        self._queue: collections.deque[Any] = collections.deque()
        # returns how many non-root unsharded buffers are currently allocated
        self._live_buffers = live_buffers

    def __len__(self) -> int:
        return len(self._queue)

    def enqueue(self, free_event: Any) -> None:
        """Remember the event recorded right after a free."""
        self._queue.append(free_event)

    def dequeue_if_needed(self, counted: bool = True, early_prefetch: bool = False) -> Any | None:
        """Return the oldest free event if one more all-gather would exceed the bound.

        Args:
            counted: the buffer about to be all-gathered counts toward the bound (False
                for the root's, which the bound excludes).
            early_prefetch: the all-gather is an early prefetch (one extra slot).
        """
        allowance = MAX_INFLIGHT + (1 if early_prefetch else 0)
        resident_after_issue = len(self._queue) + self._live_buffers() + (1 if counted else 0)
        if self._queue and resident_after_issue > allowance:
            return self._queue.popleft()
        return None
