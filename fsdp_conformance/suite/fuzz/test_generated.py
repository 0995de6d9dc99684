"""Generated models and training programs vs DDP (``fuzz.generated``), as a base class:

    class TestMyGeneratedModels(BaseGeneratedModelTests):
        fuzz_examples = 50          # more cases (default 12: the suite's run stays in budget)
        fuzz_seed = 1

One test runs the whole hypothesis loop in one rank set (docs/fuzz.md); a failure names the
minimal case, the first difference and the ``fsdp-conformance fuzz`` command that reproduces it.
"""

from __future__ import annotations

from typing import Any, ClassVar

import pytest

from fsdp_conformance.adapters import UnsupportedFeatureError

from ..declare import check
from . import driver


class BaseGeneratedModelTests:
    """Every generated case matches DDP, sees legal states and finishes (docs/fuzz.md)."""

    fuzz_examples: ClassVar[int] = 12  # cases run (refused ones are not counted)
    fuzz_seed: ClassVar[int] = 0  # hypothesis seed

    @check(
        "fuzz.generated",
        "generated models, wrap plans, configs and training programs match DDP, with legal "
        "states and no hang (shrunk to a repro.py)",
        strict=False,
        case="the generated FuzzCase (per case; None for the whole cell)",
    )
    @pytest.mark.world_size(2)
    def test_generated_models_match_ddp(self, fsdp_adapter: Any, dist: Any):
        try:
            driver.require_hypothesis()
        except ImportError as error:
            pytest.skip(str(error))
        result = driver.fuzz(fsdp_adapter, dist, self.fuzz_examples, self.fuzz_seed)
        command = (
            f"fsdp-conformance fuzz --impl {dist.impl} --seed {self.fuzz_seed} --examples "
            f"{self.fuzz_examples} --world-size {dist.world_size}"
        )
        if result.status == "unsatisfiable":
            # every drawn case was refused with a clear error: the check does not apply
            raise UnsupportedFeatureError(
                fsdp_adapter.name,
                "generated models",
                f"no generated case could run: {result.message}",
            )
        assert result.status == "pass", (
            f"adapter {fsdp_adapter.name!r}: a generated case differs from DDP after "
            f"{result.found_at} examples (shrunk in {result.shrinks} runs):\n"
            f"{result.description}\nfirst difference: {result.message}\n"
            f"reproduce and write its repro.py: {command}"
        )


class TestGeneratedModels(BaseGeneratedModelTests):
    pass
