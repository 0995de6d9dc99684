"""Prefetch overlaps communication with computation (``overlap``; [Note: overlap timing] in
overlap.py)."""

from __future__ import annotations

from typing import Any, ClassVar

import pytest

from fsdp_conformance.adapters import Feature
from fsdp_conformance.adapters import features as adapter_features

from . import overlap
from .declare import check


class BaseOverlapTests:
    """Prefetch overlaps communication with computation ([Note: overlap timing])."""

    retries: ClassVar[int] = 1

    @check("overlap", "communication overlaps computation")
    @pytest.mark.world_size(2)
    @pytest.mark.fsdp_mode("process")  # patches ProcessGroup methods process-wide
    def test_prefetch_overlaps_communication_cpu(self, fsdp_adapter: Any, dist: Any):
        if dist.device.type != "cpu":
            pytest.skip("the CPU overlap check runs on CPU ranks (gloo); this world has GPUs")
        adapter = fsdp_adapter
        adapter_features.skip_unless(adapter, Feature.FORWARD_PREFETCH, Feature.LIMIT_ALL_GATHERS)
        times = overlap.check_overlap(adapter, dist, f"adapter {adapter.name!r}", self.retries)
        print(f"overlap ratio {times.cpu_ratio(overlap.CPU_COMM_MS):.3f}: {times.describe()}")

    @check("overlap")
    @pytest.mark.cuda
    @pytest.mark.world_size(2)
    @pytest.mark.fsdp_mode("process")
    def test_prefetch_overlaps_communication_cuda(self, fsdp_adapter: Any, dist: Any):
        if dist.device.type != "cuda":
            pytest.skip(f"the CUDA overlap check needs a GPU; the ranks run on {dist.device}")
        adapter_features.skip_unless(fsdp_adapter, Feature.LIMIT_ALL_GATHERS)
        overlap.check_overlap(fsdp_adapter, dist, f"adapter {fsdp_adapter.name!r}", self.retries)


class TestOverlap(BaseOverlapTests):
    pass
