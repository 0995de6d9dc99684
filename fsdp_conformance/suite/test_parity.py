"""DDP parity checks (training, summon_full_params, state dict round trips), as base classes
to subclass (``class TestMyParity(BaseDDPParityTests): coverage = "pairwise"``). Every test body
runs in every rank.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
from typing import Any, ClassVar

import pytest
import torch

from fsdp_conformance.adapters import Feature
from fsdp_conformance.adapters import features as adapter_features
from fsdp_conformance.checks import CheckFailure

from . import configs, training, zoo
from .declare import check

# fp32 is bit-exact at world sizes 1 and 2 (dividing by 2 is exact); at 4 the order differs
ATOL_WORLD_SIZE_4 = 1e-6
RTOL_WORLD_SIZE_4 = 1e-6
# bf16 against fp32 DDP (fp32 parameters); measured after 3 steps: 9.2e-5 (nested), 9.7e-4
# (the transformer's tied embedding), alike for impl, torch FSDP1 and FSDP2
ATOL_BF16_PARAMS = 2e-3
RTOL_BF16_LOSSES = 2e-2


def tolerance(world_size: int) -> tuple[float, float]:
    """(atol, rtol) of the fp32 parity check at `world_size`."""
    return (0.0, 0.0) if world_size <= 2 else (ATOL_WORLD_SIZE_4, RTOL_WORLD_SIZE_4)


class BaseDDPParityTests:
    """Losses and full parameters after 3 SGD+momentum steps equal DDP's, over the configs of
    configs.py (a config the adapter does not support skips with its reason)."""

    models: ClassVar[tuple[str, ...]] = zoo.MODEL_NAMES
    large_world_models: ClassVar[tuple[str, ...]] = ("nested", "transformer")  # also at 4
    # 2 gets `coverage` ("full" or "pairwise"; --fsdp-coverage overrides), 1 and 4 one config
    # per sharding strategy
    world_sizes: ClassVar[tuple[int, ...]] = (1, 2, 4)
    coverage: ClassVar[str] = "full"
    # the bf16 check's models (bf16 params and reduction vs fp32 DDP)
    mixed_precision_models: ClassVar[tuple[str, ...]] = ("nested", "transformer_without_batchnorm")

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
        api=(
            "FullyShardedDataParallel()",
            "FullyShardedDataParallel(process_group=ProcessGroup)",
            "FullyShardedDataParallel(sharding_strategy)",
            "ShardingStrategy.FULL_SHARD",
            "ShardingStrategy.SHARD_GRAD_OP",
            "ShardingStrategy.NO_SHARD",
            "FullyShardedDataParallel(backward_prefetch)",
            "FullyShardedDataParallel(backward_prefetch=None)",
            "BackwardPrefetch.BACKWARD_PRE",
            "BackwardPrefetch.BACKWARD_POST",
            "FullyShardedDataParallel(forward_prefetch=True)",
            "FullyShardedDataParallel(limit_all_gathers=False)",
            "FullyShardedDataParallel(auto_wrap_policy=Callable)",
        ),
    )
    def test_matches_ddp(self, fsdp_adapter: Any, dist: Any, parity_case: configs.ParityCase):
        case = parity_case
        result = training.fsdp_run(
            fsdp_adapter, case.model, dist, case.wrap_config, case.device_init
        )
        label = f"adapter {fsdp_adapter.name!r}, {case.describe()}"
        reference = training.reference_run(case.model, dist)
        training.assert_same_training(label, result, reference, *tolerance(dist.world_size))

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
            label, result, reference, atol=ATOL_BF16_PARAMS, loss_rtol=RTOL_BF16_LOSSES
        )


class BaseSummonFullParamsTests:
    """`summon_full_params` with writeback changes the sharded parameters (those registered on
    the wrapped model: flat or DTensor shards); without, it does not."""

    @pytest.fixture(params=["nested", "transformer"])
    def summon_model(self, request: pytest.FixtureRequest) -> str:
        return request.param

    @check(
        "parity.summon_full_params",
        "summon_full_params shows the full parameters; writeback writes them back",
        api=(  # torch-fsdp1: FSDP.summon_full_params(model, writeback=...)
            "FullyShardedDataParallel.summon_full_params()",
            "FullyShardedDataParallel.summon_full_params(writeback=False)",
        ),
        features=("summon_full_params",),
        case="writeback (bool)",
        case_of="writeback",
    )
    @pytest.mark.world_size(2)
    @pytest.mark.parametrize("writeback", [True, False], ids=["writeback", "no_writeback"])
    def test_summon_full_params(
        self, fsdp_adapter: Any, dist: Any, summon_model: str, writeback: bool
    ):
        if writeback:
            adapter_features.skip_unless(fsdp_adapter, Feature.SUMMON_FULL_PARAMS_WRITEBACK)
        root, zoo_model = training.build(fsdp_adapter, summon_model, dist, {})
        training.train(root, zoo_model, dist.device, steps=1, adapter=fsdp_adapter)
        full_before = fsdp_adapter.full_params(root)
        shards_before = training.local_shards(root)
        with fsdp_adapter.summon_full_params(root, writeback=writeback), torch.no_grad():
            # the registered parameters by the unwrapped model's names (the unwrapped's first)
            named = itertools.chain(
                root.named_parameters(remove_duplicate=False),
                fsdp_adapter.unwrap(root).named_parameters(remove_duplicate=False),
            )
            by_name = training.by_clean_name(fsdp_adapter, named)
            # a tied parameter is listed under each name: increase it once
            for param in {id(by_name[name]): by_name[name] for name in full_before}.values():
                param.add_(1.0)
        full_after = fsdp_adapter.full_params(root)
        shards_after = training.local_shards(root)
        label = f"adapter {fsdp_adapter.name!r}, {summon_model}"
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
    """State dict round trips, the implementation's own (``Adapter.state_dict``) and the
    wrapped module's default ``state_dict()`` (what users get: full, DTensor shards or ZeRO-3
    placeholders): save after one step, train two more, load; the full parameters are the
    saved ones."""

    @check(
        "parity.state_dict",
        "state_dict / load_state_dict round trip",
        case="zoo model name",
        case_of="model_name",
    )
    @pytest.mark.world_size(2)
    @pytest.mark.parametrize("model_name", ["nested", "transformer"])
    def test_state_dict_round_trip(self, fsdp_adapter: Any, dist: Any, model_name: str):
        _state_dict_round_trip(fsdp_adapter, dist, model_name, default=False)

    @check(
        "parity.default_state_dict",
        "the wrapped module's default state_dict() / load_state_dict() round trip",
        case="zoo model name",
        case_of="model_name",
    )
    @pytest.mark.world_size(2)
    @pytest.mark.parametrize("model_name", ["nested", "transformer"])
    def test_default_state_dict_round_trip(self, fsdp_adapter: Any, dist: Any, model_name: str):
        _state_dict_round_trip(fsdp_adapter, dist, model_name, default=True)


def _state_dict_round_trip(adapter: Any, dist: Any, model_name: str, default: bool) -> None:
    """Save after one step, train two more, load: the full parameters are the saved ones."""
    root, zoo_model = training.build(adapter, model_name, dist, {})
    training.train(root, zoo_model, dist.device, steps=1, adapter=adapter)
    saved_full = adapter.full_params(root)
    if default:
        path = "the wrapped module's default state_dict() / load_state_dict()"
        state, load = root.state_dict(), root.load_state_dict
    else:
        path = "the adapter's state_dict / load_state_dict (the implementation's own)"
        state, load = adapter.state_dict(root), functools.partial(adapter.load_state_dict, root)
    state = {key: _clone(value) for key, value in state.items()}
    training.train(root, zoo_model, dist.device, steps=2, adapter=adapter)
    moved = adapter.full_params(root)
    assert any(not torch.equal(moved[name], saved_full[name]) for name in saved_full), (
        "training did not change any parameter; the round trip would prove nothing"
    )
    load(state)
    loaded = adapter.full_params(root)
    label = f"adapter {adapter.name!r}, {model_name}, {path}"
    unchanged = [name for name in saved_full if torch.equal(loaded[name], moved[name])]
    for name, expected in saved_full.items():
        if torch.equal(loaded[name], expected):
            continue
        gap = (loaded[name] - expected).abs().max().item()
        message = (
            f"{label}: after loading the state saved at step 1, full parameter {name!r} differs "
            f"from the saved one by {gap:.3g}"
        )
        if len(unchanged) == len(saved_full):
            message += "; the load restored nothing (every full parameter kept its trained value)"
            raise CheckFailure(message, "the load restored nothing")
        raise CheckFailure(message, "a loaded parameter differs from the saved one", gap=gap)


def _clone(value: Any) -> Any:
    return value.detach().clone() if isinstance(value, torch.Tensor) else value


class TestDDPParity(BaseDDPParityTests): ...


class TestSummonFullParams(BaseSummonFullParamsTests): ...


class TestStateDict(BaseStateDictTests): ...
