"""DDP parity checks (training, summon_full_params, state dict round trips), as base classes
to subclass.

    class TestMyParity(BaseDDPParityTests):        # in your tests; pytest collects Test*
        coverage = "pairwise"                      # optional: see configs.py [Note: coverage]

The FSDP under test is the `fsdp_adapter` fixture (``--fsdp-impl``; override the `fsdp_impl`
fixture to pick another adapter for one class). Every test body runs in every rank.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import pytest
import torch

from fsdp_conformance.adapters import Feature
from fsdp_conformance.adapters import features as adapter_features
from fsdp_conformance.adapters import loop as adapter_loop

from . import configs, training, zoo
from .declare import check

# Tolerances (measured with torch FSDP1/FSDP2 and impl on CPU, torch 2.13.0):
# world sizes 1 and 2 are bit-exact in fp32 (dividing by 2 is exact, one summation order);
# at 4 the reduction order differs from DDP's.
ATOL_WORLD_SIZE_4 = 1e-6
RTOL_WORLD_SIZE_4 = 1e-6
# bf16 compute and reduction against an fp32 DDP reference (parameters stay fp32); measured
# max |difference| after 3 steps: 9.2e-5 (nested), 9.7e-4 (the tied embedding of the
# transformer), the same for impl, torch FSDP1 and torch FSDP2
ATOL_BF16_PARAMS = 2e-3
RTOL_BF16_LOSSES = 2e-2


def tolerance(world_size: int) -> tuple[float, float]:
    """(atol, rtol) of the fp32 parity check at `world_size`."""
    return (0.0, 0.0) if world_size <= 2 else (ATOL_WORLD_SIZE_4, RTOL_WORLD_SIZE_4)


class BaseDDPParityTests:
    """Losses and full parameters after 3 SGD+momentum steps equal DDP's.

    Parametrised over zoo model x sharding strategy x backward_prefetch x forward_prefetch x
    limit_all_gathers x cpu_offload x device init x world size (see configs.py). A config the
    adapter does not support skips with the adapter's reason.
    """

    # Zoo models to train (fsdp_conformance.suite.zoo.MODELS)
    models: ClassVar[tuple[str, ...]] = zoo.MODEL_NAMES
    # Models also run at world size 4
    large_world_models: ClassVar[tuple[str, ...]] = ("nested", "transformer")
    # World sizes (2 gets `coverage`; 1 and 4 one config per sharding strategy)
    world_sizes: ClassVar[tuple[int, ...]] = (1, 2, 4)
    # "full" or "pairwise" at world size 2; --fsdp-coverage overrides
    coverage: ClassVar[str] = "full"
    # Models of the mixed precision check (bf16 params and reduction vs fp32 DDP)
    mixed_precision_models: ClassVar[tuple[str, ...]] = (
        "nested",
        "transformer_without_batchnorm",
    )

    def pytest_generate_tests(self, metafunc: pytest.Metafunc) -> None:
        coverage = metafunc.config.getoption("fsdp_coverage", None) or self.coverage
        if "parity_case" in metafunc.fixturenames:
            dimensions = configs.dimensions_for_impl(metafunc.config.getoption("fsdp_impl", None))
            cases = configs.parity_cases(
                self.models, coverage, self.world_sizes, self.large_world_models, dimensions
            )
            metafunc.parametrize("parity_case", [case.param() for case in cases])
        if "mixed_precision_case" in metafunc.fixturenames:
            cases = [
                configs.ParityCase(model, 2, (("sharding_strategy", strategy),))
                for model in self.mixed_precision_models
                for strategy in configs.SHARDING_STRATEGIES
            ]
            metafunc.parametrize("mixed_precision_case", [case.param() for case in cases])

    @check(
        "parity.ddp",
        "training matches DDP (losses and full parameters)",
        case="configs.ParityCase",
        case_of="parity_case",
    )
    def test_matches_ddp(self, fsdp_adapter: Any, dist: Any, parity_case: configs.ParityCase):
        case = parity_case
        result = training.fsdp_run(
            fsdp_adapter, case.model, dist, case.wrap_config, case.device_init
        )
        reference = training.reference_run(case.model, dist)
        atol, rtol = tolerance(dist.world_size)
        training.assert_same_training(
            f"adapter {fsdp_adapter.name!r}, {case.describe()}", result, reference, atol, rtol
        )

    @check(
        "parity.bf16",
        "bf16 mixed precision matches fp32 DDP within tolerance",
        case="configs.ParityCase",
        case_of="mixed_precision_case",
    )
    def test_mixed_precision_matches_fp32_ddp(
        self, fsdp_adapter: Any, dist: Any, mixed_precision_case: configs.ParityCase
    ):
        case = mixed_precision_case
        config = {
            **case.wrap_config,
            "mixed_precision": {"param_dtype": torch.bfloat16, "reduce_dtype": torch.bfloat16},
        }
        # bf16 gradients are judged by the fp32 parameters they produce, not one by one
        result = dataclasses.replace(
            training.fsdp_run(fsdp_adapter, case.model, dist, config), grads=None
        )
        reference = training.reference_run(case.model, dist)
        label = f"adapter {fsdp_adapter.name!r}, {case.describe()}, bf16 params and reduction"
        # losses: bf16 forward vs fp32, relative; parameters: fp32 master weights, absolute
        training.assert_same_training(
            label,
            result,
            reference,
            atol=ATOL_BF16_PARAMS,
            rtol=0.0,
            loss_atol=0.0,
            loss_rtol=RTOL_BF16_LOSSES,
        )


class BaseSummonFullParamsTests:
    """`summon_full_params` with writeback changes the sharded parameters; without, it does not.

    The sharded parameters are what the implementation registers on the wrapped model (flat
    shards for FSDP1-style implementations, DTensor shards for FSDP2), read before and after;
    the full parameters are read back through the adapter.
    """

    @pytest.fixture(params=["nested", "transformer"])
    def summon_model(self, request: pytest.FixtureRequest) -> str:
        return request.param

    @check(
        "parity.summon_full_params",
        "summon_full_params shows the full parameters; writeback writes them back",
        features=("summon_full_params",),
        case="writeback (bool)",
        case_of="writeback",
    )
    @pytest.mark.world_size(2)
    @pytest.mark.parametrize("writeback", [True, False], ids=["writeback", "no_writeback"])
    def test_summon_full_params(
        self, fsdp_adapter: Any, dist: Any, summon_model: str, writeback: bool
    ):
        adapter = fsdp_adapter
        if writeback:
            adapter_features.skip_unless(adapter, Feature.SUMMON_FULL_PARAMS_WRITEBACK)
        root, zoo_model = training.wrap_model(adapter, summon_model, dist, {})
        training.train(root, zoo_model, dist.device, steps=1, adapter=adapter)
        full_before = adapter_loop.full_params(adapter, root)
        shards_before = _local_shards(root)
        with adapter.summon_full_params(root, writeback=writeback), torch.no_grad():
            increased = set()  # a tied parameter is listed under each name: increase it once
            by_name = _params_by_clean_name(adapter, root)
            for name in full_before:
                param = by_name[name]
                if id(param) not in increased:
                    increased.add(id(param))
                    param.add_(1.0)
        full_after = adapter_loop.full_params(adapter, root)
        shards_after = _local_shards(root)
        label = f"adapter {adapter.name!r}, {summon_model}"
        changed = sorted(
            name
            for name in shards_before
            if not torch.equal(shards_before[name], shards_after[name])
        )
        if writeback:
            # registered parameters holding this rank's data must change; an implementation
            # that keeps its shards elsewhere (DeepSpeed ZeRO-3 registers 0-element
            # placeholders) is read through the adapter's full parameters below
            nonempty = [name for name, shard in shards_before.items() if shard.numel() > 0]
            assert set(changed) == set(nonempty), (
                f"{label}: summon_full_params(writeback=True) with every full parameter "
                f"increased by 1 left these sharded parameters unchanged: "
                f"{sorted(set(nonempty) - set(changed))}"
            )
            for name, before in full_before.items():
                expected = before + 1.0
                assert torch.equal(full_after[name], expected), (
                    f"{label}: after summon_full_params(writeback=True), full parameter "
                    f"{name!r} is not its old value + 1 (max |difference| "
                    f"{(full_after[name] - expected).abs().max().item():.3g})"
                )
        else:
            assert not changed, (
                f"{label}: summon_full_params(writeback=False) changed the sharded parameters "
                f"{changed} (changes inside the context must be discarded)"
            )
            for name, before in full_before.items():
                assert torch.equal(full_after[name], before), (
                    f"{label}: after summon_full_params(writeback=False), full parameter "
                    f"{name!r} changed"
                )


class BaseStateDictTests:
    """State dict round trips: the implementation's own (``Adapter.state_dict`` /
    ``Adapter.load_state_dict``) and, separately, the wrapped module's default
    ``module.state_dict()`` / ``load_state_dict()``.

    Each saves after one step, trains two more (the parameters move), loads the saved state dict
    and checks that the full parameters are the saved ones. The implementation's own path is
    what it promises; the default path is what a user calling ``model.state_dict()`` gets (full
    for FSDP1-style implementations, sharded DTensors for FSDP2, 0-element placeholders for
    DeepSpeed ZeRO-3), checked on its own so that "load restores nothing" is reported as that.
    """

    @check(
        "parity.state_dict",
        "state_dict / load_state_dict round trip",
        case="zoo model name",
        case_of="model_name",
    )
    @pytest.mark.world_size(2)
    @pytest.mark.parametrize("model_name", ["nested", "transformer"])
    def test_state_dict_round_trip(self, fsdp_adapter: Any, dist: Any, model_name: str):
        adapter = fsdp_adapter
        _state_dict_round_trip(
            adapter,
            dist,
            model_name,
            adapter.state_dict,
            adapter.load_state_dict,
            "the adapter's state_dict / load_state_dict (the implementation's own)",
        )

    @check(
        "parity.default_state_dict",
        "the wrapped module's default state_dict() / load_state_dict() round trip",
        case="zoo model name",
        case_of="model_name",
    )
    @pytest.mark.world_size(2)
    @pytest.mark.parametrize("model_name", ["nested", "transformer"])
    def test_default_state_dict_round_trip(self, fsdp_adapter: Any, dist: Any, model_name: str):
        adapter = fsdp_adapter
        _state_dict_round_trip(
            adapter,
            dist,
            model_name,
            lambda root: root.state_dict(),
            lambda root, state: root.load_state_dict(state),
            "the wrapped module's default state_dict() / load_state_dict()",
        )


def _state_dict_round_trip(
    adapter: Any,
    dist: Any,
    model_name: str,
    save: Any,
    load: Any,
    path: str,
) -> None:
    """Save after one step, train two more, load: the full parameters are the saved ones."""
    root, zoo_model = training.wrap_model(adapter, model_name, dist, {})
    training.train(root, zoo_model, dist.device, steps=1, adapter=adapter)
    saved_full = adapter_loop.full_params(adapter, root)
    state = {key: _clone(value) for key, value in save(root).items()}
    training.train(root, zoo_model, dist.device, steps=2, adapter=adapter)
    moved = adapter_loop.full_params(adapter, root)
    assert any(not torch.equal(moved[name], saved_full[name]) for name in saved_full), (
        "training did not change any parameter; the round trip would prove nothing"
    )
    load(root, state)
    loaded = adapter_loop.full_params(adapter, root)
    label = f"adapter {adapter.name!r}, {model_name}, {path}"
    unchanged = [name for name in saved_full if torch.equal(loaded[name], moved[name])]
    for name, expected in saved_full.items():
        assert torch.equal(loaded[name], expected), (
            f"{label}: after loading the state saved at step 1, full parameter {name!r} differs "
            f"from the saved one by {(loaded[name] - expected).abs().max().item():.3g}"
            + (
                "; the load restored nothing (every full parameter kept its trained value)"
                if len(unchanged) == len(saved_full)
                else ""
            )
        )


def _clone(value: Any) -> Any:
    return value.detach().clone() if isinstance(value, torch.Tensor) else value


def _params_by_clean_name(adapter: Any, root: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The registered parameters of `root` under the unwrapped model's names (wrapper segments
    removed, tied parameters under each name): no attribute lookup through wrappers."""
    from fsdp_conformance.adapters.base import clean_param_name

    params = {}
    for module in (adapter.unwrap(root), root):
        for name, param in module.named_parameters(remove_duplicate=False):
            params.setdefault(
                clean_param_name(name, adapter_features.declared(adapter).wrapper_segments), param
            )
    return params


def _local_shards(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Copies of this rank's registered parameters (flat shards / DTensor local shards)."""
    from torch.distributed.tensor import DTensor

    shards = {}
    for name, param in model.named_parameters():
        local = param.to_local() if isinstance(param, DTensor) else param
        shards[name] = local.detach().clone()
    return shards


class TestDDPParity(BaseDDPParityTests):
    pass


class TestSummonFullParams(BaseSummonFullParamsTests):
    pass


class TestStateDict(BaseStateDictTests):
    pass
