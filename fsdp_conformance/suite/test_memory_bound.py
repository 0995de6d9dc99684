"""The two-instance memory bound of limit_all_gathers (collected by ``--pyargs``)."""

from __future__ import annotations

from fsdp_conformance.suite.memory_bound import BaseMemoryBoundTests


class TestMemoryBound(BaseMemoryBoundTests):
    pass
