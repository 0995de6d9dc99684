"""The all-gather rate limiter: a queue of free events.

[Note: residency bound]
Before each all-gather issue, while queued free events + non-root buffers unsharded now + 1
exceeds MAX_INFLIGHT (+1 for an early prefetch), the oldest free event is synchronized; the rule
and how it differs from torch FSDP1 (which counts only frees) are in docs/impl.md.
"""

from __future__ import annotations

import collections
from collections.abc import Callable
from typing import Any

from fsdp_conformance import constants

# the instance computing now and the one whose all-gather is in flight (FSDP1's depth)
MAX_INFLIGHT = constants.MAX_INFLIGHT


class FreeEventQueue:
    """Free events of resharded buffers, oldest first, shared by one root's instances.

    Args:
        live_buffers: returns how many non-root unsharded buffers are allocated now.
    """

    def __init__(self, live_buffers: Callable[[], int]) -> None:
        self._queue: collections.deque[Any] = collections.deque()
        self._live_buffers = live_buffers

    def enqueue(self, free_event: Any) -> None:
        self._queue.append(free_event)

    def dequeue_if_needed(self, counted: bool = True, early_prefetch: bool = False) -> Any | None:
        """The oldest free event if one more all-gather would exceed the bound, else None.

        Args:
            counted: the buffer to be all-gathered counts (False for the root's).
            early_prefetch: the all-gather is an early prefetch (one extra slot).
        """
        allowance = MAX_INFLIGHT + (1 if early_prefetch else 0)
        resident_after_issue = len(self._queue) + self._live_buffers() + (1 if counted else 0)
        if self._queue and resident_after_issue > allowance:
            return self._queue.popleft()
        return None
