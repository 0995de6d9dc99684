"""The memory-bound check run against each built-in adapter.

``impl`` must meet the bound everywhere; ``torch-fsdp1``'s prefetching cells are strict expected
failures (docs/memory_bound.md); ``torch-fsdp2`` skips (no ``limit_all_gathers``).
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
    lag_variants = ("strict",)  # every case skips: once per check is enough

    @pytest.fixture
    def fsdp_impl(self) -> str:
        return "torch-fsdp2"
