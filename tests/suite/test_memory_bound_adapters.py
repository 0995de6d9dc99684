"""The memory-bound check run against each built-in adapter.

``impl`` must meet the bound everywhere; ``torch-fsdp1``'s prefetching cells are strict expected
failures (docs/memory_bound.md); ``torch-fsdp2`` is held to its own, stream-ordered bound (the
"limit off" case skips: its bound cannot be switched off).
"""

from __future__ import annotations

import pytest

from fsdp_conformance.suite import BaseMemoryBoundTests


class TestMemoryBoundImpl(BaseMemoryBoundTests):
    @pytest.fixture
    def fsdp_impl(self) -> str:
        return "impl"


class TestMemoryBoundTorchFSDP1(BaseMemoryBoundTests):
    @pytest.fixture
    def fsdp_impl(self) -> str:
        return "torch-fsdp1"


class TestMemoryBoundTorchFSDP2(BaseMemoryBoundTests):
    lag_variants = ("strict",)  # FSDP2 never blocks on the device: one lag variant is enough

    @pytest.fixture
    def fsdp_impl(self) -> str:
        return "torch-fsdp2"
