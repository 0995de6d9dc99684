"""DDP parity, summon_full_params and state dict checks (collected by ``--pyargs``)."""

from __future__ import annotations

from fsdp_conformance.suite.parity import (
    BaseDDPParityTests,
    BaseStateDictTests,
    BaseSummonFullParamsTests,
)


class TestDDPParity(BaseDDPParityTests):
    pass


class TestSummonFullParams(BaseSummonFullParamsTests):
    pass


class TestStateDict(BaseStateDictTests):
    pass
