"""The precision checks (suite/test_precision.py) against the built-in adapters: impl, torch
FSDP1 and torch FSDP2 run every cell (FSDP1's no_sync accumulation is its declared deviation);
fairscale runs its float16 policy when installed (its bfloat16 cells are its declared
deviation; its grad scaler cell is not applicable on a CPU-only host)."""

from __future__ import annotations

import pytest

from fsdp_conformance.suite import BasePrecisionTests


@pytest.fixture(params=("impl", "torch-fsdp1", "torch-fsdp2"))
def fsdp_impl(request: pytest.FixtureRequest) -> str:
    return request.param


class TestPrecision(BasePrecisionTests):
    pass


class TestPrecisionFairscale(BasePrecisionTests):
    policies = ("fp16-reduce-fp32",)
    accumulations = ()

    @pytest.fixture
    def fsdp_impl(self) -> str:
        pytest.importorskip("fairscale")
        return "fairscale"
