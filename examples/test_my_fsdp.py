"""A downstream project's tests: the conformance suite against its own FSDP, by subclassing.

Next to my_fsdp_adapter.py (the adapter example of docs/adapters.md). Run from this folder:

    pytest test_my_fsdp.py                 # the subclassed checks below
    pytest --pyargs fsdp_conformance.suite --fsdp-impl my_fsdp_adapter:ADAPTER   # everything

The adapter claims only FULL_SHARD and SHARD_GRAD_OP, so every check needing another feature
skips with "adapter 'my-fsdp' does not support '<feature>': not wired up in my-fsdp yet".
"""

from __future__ import annotations

import pytest

from fsdp_conformance.suite import (
    BaseDDPParityTests,
    BaseStateDictTests,
    BaseSummonFullParamsTests,
    BaseTrainingStateTests,
)


@pytest.fixture
def fsdp_impl() -> str:
    """Every suite class in this module drives my_fsdp_adapter.ADAPTER."""
    return "my_fsdp_adapter:ADAPTER"


class TestParity(BaseDDPParityTests):
    models = ("nested", "transformer")  # the zoo models this project cares about
    world_sizes = (2,)
    coverage = "pairwise"


class TestSummonFullParams(BaseSummonFullParamsTests):
    pass


class TestStateDict(BaseStateDictTests):
    pass


class TestTrainingStates(BaseTrainingStateTests):
    models = ("nested",)
