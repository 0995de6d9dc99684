"""The built-in deepspeed adapter: a small subset of the suite against DeepSpeed ZeRO.

Skipped, with the install line, when DeepSpeed is not installed (.ci/run installs the extra).
The whole suite against it: ``fsdp-conformance run --impl deepspeed`` (docs/deepspeed.md).
"""

from __future__ import annotations

import importlib
import importlib.util

import pytest

from fsdp_conformance.adapters import Feature, get_adapter
from fsdp_conformance.adapters import deepspeed as ds_adapter
from fsdp_conformance.adapters import features as adapter_features

pytest_plugins = ["pytester"]

needs_deepspeed = pytest.mark.skipif(
    importlib.util.find_spec("deepspeed") is None,
    reason="deepspeed is not installed: pip install 'fsdp-conformance[deepspeed]'",
)
# outside the adapter's declared range every cell skips with this line (test_support_ranges.py
# fails on such a torch); the tests that need cells to run say it the same way
_OUT_OF_RANGE = adapter_features.support_problem(get_adapter("deepspeed"))
needs_deepspeed_range = pytest.mark.skipif(
    _OUT_OF_RANGE is not None, reason=f"adapter 'deepspeed': {_OUT_OF_RANGE}"
)

_CHECKS = """
from fsdp_conformance.suite import (
    BaseDDPParityTests,
    BaseGeneratedModelTests,
    BaseMemoryBoundTests,
    BaseStateDictTests,
    BaseSummonFullParamsTests,
    BaseTrainingStateTests,
)
from fsdp_conformance.suite import configs
from fsdp_conformance.suite.memory_bound import BoundCase


class TestParity(BaseDDPParityTests):
    def pytest_generate_tests(self, metafunc):
        if "parity_case" in metafunc.fixturenames:
            cases = [
                configs.ParityCase("nested", 2, (("sharding_strategy", strategy),))
                for strategy in ("FULL_SHARD", "NO_SHARD")
            ]
            metafunc.parametrize("parity_case", [case.param() for case in cases])


class TestStates(BaseTrainingStateTests):
    models = ("nested",)
    backward_prefetches = ("BACKWARD_PRE",)

    def pytest_generate_tests(self, metafunc):
        if "state_case" in metafunc.fixturenames:
            case = configs.ParityCase("nested", 2, (("sharding_strategy", "FULL_SHARD"),))
            metafunc.parametrize("state_case", [case.param()])


class TestStateDict(BaseStateDictTests):
    pass


class TestSummon(BaseSummonFullParamsTests):
    pass


class TestGenerated(BaseGeneratedModelTests):
    pass


class TestMemory(BaseMemoryBoundTests):
    def pytest_generate_tests(self, metafunc):
        if "bound_case" in metafunc.fixturenames:
            case = BoundCase("strict", "FULL_SHARD", "BACKWARD_PRE", False)
            metafunc.parametrize("bound_case", [case.param()])
"""


@needs_deepspeed
@needs_deepspeed_range
def test_deepspeed_subset(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_ds=_CHECKS)
    result = pytester.runpytest_subprocess(
        "-p",
        "no:cacheprovider",
        "-rxs",
        "--fsdp-impl",
        "deepspeed",
        "-k",
        "(test_matches_ddp or test_states_are or nested or test_limited or generated) "
        "and not bf16 "
        "and not mixed_precision and not test_assert_state",
        timeout=600,
    )
    outcomes = result.parseoutcomes()
    text = result.stdout.str()
    assert outcomes.get("failed", 0) == 0 and outcomes.get("errors", 0) == 0, text
    # ZeRO-3 and ZeRO-1 parity, root states, the adapter's own state dict, summon with and
    # without writeback, the memory bound held to DeepSpeed's own bound, 12 generated cases
    assert outcomes.get("passed", 0) == 8, outcomes
    # the default module.state_dict() restores nothing on ZeRO-3: a declared deviation
    assert outcomes.get("xfailed", 0) == 1 and "parity.default_state_dict" in text, text


def test_without_deepspeed_every_feature_says_how_to_install(monkeypatch) -> None:
    monkeypatch.setattr(
        ds_adapter.importlib.util, "find_spec", lambda name, *a: None if name == "deepspeed" else 1
    )
    adapter = ds_adapter.DeepSpeedAdapter()
    reason = adapter_features.why_unsupported(adapter, Feature.FULL_SHARD)
    assert reason is not None and "pip install 'fsdp-conformance[deepspeed]'" in reason
    assert set(dict(adapter.declarations.unsupported)) == set(ds_adapter.ALL_FEATURES)


def test_missing_compiler_is_one_line(monkeypatch, tmp_path) -> None:
    # only when the op is used (LOCAL_SIZE = world size); otherwise nothing is built
    monkeypatch.delenv("LOCAL_SIZE", raising=False)
    assert ds_adapter._compiler_problem() is None
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    monkeypatch.delenv("CXX", raising=False)
    monkeypatch.setattr(ds_adapter.shutil, "which", lambda name: None)
    monkeypatch.setattr(ds_adapter, "_cpu_host", lambda: True)
    monkeypatch.setattr(ds_adapter, "_shm_op_used", lambda: True)
    problem = ds_adapter._compiler_problem()
    assert problem is not None and "\n" not in problem and "compiler" in problem
    assert str(tmp_path) in problem


@needs_deepspeed
def test_the_shm_op_is_built_only_where_deepspeed_uses_it(monkeypatch, tmp_path) -> None:
    """DeepSpeed's CPU backend builds its shm op at init_distributed (a JIT build of minutes)
    though it uses it only where LOCAL_SIZE equals the world size: elsewhere no op, no build."""
    from fsdp_conformance import _patching

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    monkeypatch.delenv("LOCAL_SIZE", raising=False)
    ds_adapter.prepare_environment()
    ds_adapter._build_shm_op_only_where_used()
    backend = importlib.import_module("deepspeed.comm.torch")
    record = next(r for r in _patching.active_patches() if r.owner is backend)
    try:
        assert backend.build_shm_op is record.replacement
        assert backend.build_shm_op() is None
        assert list(tmp_path.iterdir()) == [], "the op was built"
    finally:
        record.undo()


def test_registered_builtin() -> None:
    from fsdp_conformance.adapters import BUILTIN_ADAPTERS

    assert "deepspeed" in BUILTIN_ADAPTERS
    assert get_adapter("deepspeed").name == "deepspeed"
    assert get_adapter("deepspeed").declarations.instance_states is False


_ACCUMULATION = """
from fsdp_conformance.adapters.deepspeed import DeepSpeedAdapter


class ForgetsTheBoundary(DeepSpeedAdapter):
    # the adapter before accumulation_boundary: every backward is an engine boundary
    name = "deepspeed-no-boundary"

    def accumulation_boundary(self, model, boundary):
        pass


NO_BOUNDARY = ForgetsTheBoundary()
"""

_ACCUMULATION_CHECKS = """
from fsdp_conformance.suite import BaseGradientAccumulationTests


class TestAccumulation(BaseGradientAccumulationTests):
    models = ("loops",)
    strategies = ("SHARD_GRAD_OP", "NO_SHARD")
    syncs = ("sync_every",)
"""


@needs_deepspeed
@needs_deepspeed_range
@pytest.mark.parametrize(
    "impl, failed", [("deepspeed", 0), ("outside_ds:NO_BOUNDARY", 2)], ids=["builtin", "broken"]
)
def test_accumulation_over_synchronised_micro_batches(
    pytester: pytest.Pytester, impl: str, failed: int
) -> None:
    """Three backwards, then one step, on ZeRO-2 and ZeRO-1: the engine must be told which
    backward ends the step (accumulation_boundary), else it keeps only the last micro-batch's
    gradient (measured: 0.035 off DDP) -- the broken variant shows the check sees it."""
    pytester.makepyfile(outside_ds=_ACCUMULATION, test_acc=_ACCUMULATION_CHECKS)
    result = pytester.runpytest_subprocess(
        "-p", "no:cacheprovider", "-rf", "--fsdp-impl", impl, "-k", "matches_ddp", timeout=600
    )  # fmt: skip
    outcomes = result.parseoutcomes()
    assert outcomes.get("failed", 0) == failed, result.stdout.str()
    assert outcomes.get("passed", 0) == 2 - failed, result.stdout.str()
