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

from fsdp_conformance import checks
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
        command = checks.shell_line(dist.impl, [
            "fsdp-conformance", "fuzz", "--impl", dist.impl, "--seed", str(self.fuzz_seed),
            "--examples", str(self.fuzz_examples), "--world-size", str(dist.world_size),
        ])  # fmt: skip
        if result.status == "unsatisfiable":
            # every drawn case was refused with a clear error: the check does not apply
            raise UnsupportedFeatureError(
                fsdp_adapter.name,
                "generated models",
                f"no generated case could run: {result.message}",
            )
        first_line = (result.message or "").strip().partition("\n")[0]
        assert result.status == "pass", (  # the first line is the matrix's: all a user needs
            f"adapter {fsdp_adapter.name!r}: a generated case differs from DDP after "
            f"{result.found_at} examples (shrunk in {result.shrinks} runs); first difference: "
            f"{first_line}; write its repro.py: `{command}`\n{result.description}\n"
            f"first difference: {result.message}"
        )


class TestGeneratedModels(BaseGeneratedModelTests): ...
