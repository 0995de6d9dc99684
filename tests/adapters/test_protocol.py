"""The small adapter protocol: `Adapter` holds the primitives, `Declarations` what it declares,
the modules' functions the rest -- and an adapter of the older, wider protocol still answers."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

import fsdp_conformance.suite  # noqa: F401  (registers the checks the deviations name)
from fsdp_conformance.adapters import (
    ALL_FEATURES,
    Adapter,
    Declarations,
    Deviation,
    EngineHooks,
    Feature,
    FeatureNotImplementedError,
    UnsupportedFeatureError,
    deviations,
    features,
    get_adapter,
    loop,
)


def test_adapter_has_at_most_16_members() -> None:
    members = [name for name in dir(Adapter) if not name.startswith("__")]
    assert len(members) <= 16, members


def test_declarations_are_one_frozen_record() -> None:
    record = Declarations(unsupported={Feature.NO_SHARD: "no"})
    with pytest.raises(dataclasses.FrozenInstanceError):
        record.grad_reduction = "sum"  # type: ignore[misc]
    for name in ("impl", "torch-fsdp1", "torch-fsdp2", "fairscale", "deepspeed"):
        assert isinstance(features.declared(get_adapter(name)), Declarations), name


class _New(Adapter):
    name = "new-style"
    declarations = Declarations(
        unsupported={Feature.NO_SHARD: "always shards"},
        known_deviations=(Deviation("misuse.wrap_twice", "accepts it"),),
        grad_reduction="sum",
    )


class _Old(Adapter):
    name = "old-style"
    known_deviations = (Deviation("misuse.wrap_twice", "accepts it"),)
    grad_reduction = "sum"

    def unsupported(self) -> dict[str, str]:
        return {Feature.NO_SHARD: "always shards"}

    def optimizer(self, model: nn.Module, name: str = "sgd", **options: object) -> str:
        return "own optimizer"


@pytest.mark.parametrize("adapter", [_New(), _Old()], ids=["new", "old"])
def test_new_and_old_declarations_read_alike(adapter: Adapter) -> None:
    assert not features.supports(adapter, Feature.NO_SHARD)
    assert features.supports(adapter, Feature.FULL_SHARD)
    assert features.why_unsupported(adapter, Feature.NO_SHARD) == "always shards"
    assert features.capabilities(adapter) == ALL_FEATURES - {Feature.NO_SHARD}
    with pytest.raises(UnsupportedFeatureError, match="does not support 'no_shard'"):
        features.require(adapter, Feature.NO_SHARD)
    assert features.declared(adapter).grad_reduction == "sum"
    assert deviations.deviation_reason(adapter, "misuse.wrap_twice") == "accepts it"
    # the older protocol's methods still answer, through the module functions
    assert adapter.supports(Feature.FULL_SHARD) and adapter.known_deviations
    assert adapter.unsupported_reason(Feature.NO_SHARD) == "always shards"


def test_hooks_use_the_adapters_own_else_the_plain_behaviour() -> None:
    model = nn.Linear(2, 2)
    assert loop.optimizer(_Old(), model) == "own optimizer"
    assert isinstance(loop.optimizer(_New(), model), torch.optim.SGD)
    assert loop.overrides(_Old(), "optimizer") and not loop.overrides(_New(), "optimizer")

    class Engine(EngineHooks, Adapter):
        def backward(self, model: nn.Module, loss: torch.Tensor) -> None:
            super().backward(model, loss * 2)

    engine = Engine()
    assert loop.overrides(engine, "backward") and not loop.overrides(engine, "optimizer")
    loop.backward(engine, model, model(torch.ones(1, 2)).sum())
    assert torch.equal(model.bias.grad, torch.full((2,), 2.0))


def test_a_missing_primitive_fails_naming_adapter_member_and_feature() -> None:
    with pytest.raises(FeatureNotImplementedError, match=r"'new-style'.*Adapter\._wrap"):
        _New().wrap(nn.Linear(2, 2))
    with pytest.raises(FeatureNotImplementedError, match=r"Adapter\._observe.*'comm_trace'"):
        _New().observe(lambda *args: None)
    with pytest.raises(AttributeError, match="'_New' object has no attribute 'no_such'"):
        _New().no_such  # noqa: B018
