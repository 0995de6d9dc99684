"""The adapter protocol: `Adapter` holds the primitives and the training-loop hooks (ordinary
methods, so ``super()`` reaches them), `Declarations` what it declares; a name removed from the
protocol fails where the adapter is defined or resolved, with one line naming its replacement
(docs/adapters.md, "Removed names"; the tables themselves: test_docs_adapters.py)."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import fsdp_conformance.suite  # noqa: F401  (registers the checks the deviations name)
from fsdp_conformance.adapters import (
    ALL_FEATURES,
    Adapter,
    Declarations,
    Deviation,
    Envelope,
    Feature,
    FeatureNotImplementedError,
    UnsupportedFeatureError,
    _removed,
    base,
    deviations,
    features,
    get_adapter,
    registry,
)
from fsdp_conformance.adapters.impl import ImplAdapter


def test_declarations_are_one_frozen_record() -> None:
    record = Declarations(unsupported={Feature.NO_SHARD: "no"})
    with pytest.raises(dataclasses.FrozenInstanceError):
        record.grad_reduction = "sum"  # type: ignore[misc]
    for name in ("impl", "torch-fsdp1", "torch-fsdp2", "fairscale", "deepspeed"):
        assert isinstance(get_adapter(name).declarations, Declarations), name


class _Declaring(Adapter):
    name = "declaring"
    declarations = Declarations(
        unsupported={Feature.NO_SHARD: "always shards"},
        known_deviations=(
            Deviation("misuse.wrap_twice", "accepts it", envelope=Envelope("no error raised")),
        ),
        grad_reduction="sum",
    )


def test_the_module_functions_read_the_declarations() -> None:
    adapter = _Declaring()
    assert not features.supports(adapter, Feature.NO_SHARD)
    assert features.supports(adapter, Feature.FULL_SHARD)
    assert features.why_unsupported(adapter, Feature.NO_SHARD) == "always shards"
    api_families = {Feature.FSDP1_API, Feature.FSDP2_API}  # opt-in: Declarations.api
    assert features.capabilities(adapter) == ALL_FEATURES - {Feature.NO_SHARD} - api_families
    with pytest.raises(UnsupportedFeatureError, match="does not support 'no_shard'"):
        features.require(adapter, Feature.NO_SHARD)
    assert deviations.deviation_reason(adapter, "misuse.wrap_twice") == "accepts it"


def test_hooks_are_methods_whose_plain_behaviour_super_reaches() -> None:
    model = nn.Linear(2, 2)

    class OwnOptimizer(Adapter):  # as written from the docs before the hooks moved
        def optimizer(self, model: nn.Module, name: str = "sgd", **options: object) -> object:
            optimizer = super().optimizer(model, name, **options)
            optimizer.made_by = "own"  # type: ignore[attr-defined]
            return optimizer

    optimizer = OwnOptimizer().optimizer(model, lr=0.1)
    assert isinstance(optimizer, torch.optim.SGD) and optimizer.made_by == "own"

    class Engine(Adapter):
        def backward(self, model: nn.Module, loss: torch.Tensor) -> None:
            super().backward(model, loss * 2)

    Engine().backward(model, model(torch.ones(1, 2)).sum())
    assert torch.equal(model.bias.grad, torch.full((2,), 2.0))
    with pytest.raises(UnsupportedFeatureError, match="override Adapter.no_sync"):
        Engine().no_sync(model)  # the root has no no_sync()


def test_a_missing_primitive_fails_naming_adapter_member_and_feature() -> None:
    with pytest.raises(FeatureNotImplementedError, match=r"'declaring'.*Adapter\._wrap"):
        _Declaring().wrap(nn.Linear(2, 2))
    with pytest.raises(FeatureNotImplementedError, match=r"Adapter\._observe.*'comm_trace'"):
        _Declaring().observe(lambda *args: None)
    with pytest.raises(FeatureNotImplementedError, match=r"Adapter\._assert_state"):
        _Declaring().assert_state(nn.Linear(2, 2))
    with pytest.raises(AttributeError, match="'_Declaring' object has no attribute 'no_such'"):
        _Declaring().no_such  # noqa: B018


def _line_of(error: pytest.ExceptionInfo[BaseException]) -> str:
    text = str(error.value)
    assert "\n" not in text, text
    return text


@pytest.mark.parametrize("name", sorted(_removed.REMOVED_MEMBERS))
def test_defining_a_removed_member_fails_where_the_class_is_defined(name: str) -> None:
    with pytest.raises(registry.RemovedNameError) as error:
        type("Old", (ImplAdapter,), {"__module__": "old_adapter", name: lambda self: None})
    line = _line_of(error)
    assert line.startswith("adapter old_adapter.Old uses a member removed from the Adapter"), line
    assert f"{name!r} (defined by Old)" in line, line
    assert f"use {_removed.REMOVED_MEMBERS[name]}" in line, line
    assert line.endswith('(docs/adapters.md, "Removed names")'), line


@pytest.mark.parametrize(
    "use",
    [
        "self.{name}()",
        "super().{name}",
        "(lambda: self.{name})",
        "self.{name} = 1",
    ],
    ids=["self", "super", "nested", "set"],
)
@pytest.mark.parametrize("name", sorted(_removed.REMOVED_MEMBERS))
def test_using_a_removed_member_fails_where_the_class_is_defined(name: str, use: str) -> None:
    statement = use.format(name=name)
    source = f"class Old(ImplAdapter):\n    def grad_shards(self, model):\n        {statement}\n"
    with pytest.raises(registry.RemovedNameError) as error:
        exec(source, {"ImplAdapter": ImplAdapter, "__name__": "old_adapter"})  # noqa: S102
    line = _line_of(error)
    assert f"{name!r} (used in Old.grad_shards): use {_removed.REMOVED_MEMBERS[name]}" in line


def test_module_functions_and_other_objects_are_not_removed_members() -> None:
    class Fine(ImplAdapter):
        def grad_shards(self, model: nn.Module) -> None:
            features.require(self, Feature.FULL_SHARD)  # module functions of the same names
            base.features.supports(self, Feature.FULL_SHARD)
            unsupported = self.declarations.unsupported  # a Declarations field
            return {check.check: unsupported for check in model.known_deviations}

    assert Fine().name == "impl"


def test_get_adapter_refuses_a_removed_member_set_on_the_instance(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "instance_attr_adapter.py").write_text(
        "from fsdp_conformance.adapters.impl import ImplAdapter\n"
        "ADAPTER = ImplAdapter()\n"
        "ADAPTER.grad_reduction = 'sum'\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        with pytest.raises(registry.RemovedNameError, match=r"'grad_reduction' \(set on the inst"):
            get_adapter("instance_attr_adapter:ADAPTER")
    finally:
        sys.modules.pop("instance_attr_adapter", None)


@pytest.mark.parametrize("name", sorted(_removed.REMOVED_EXPORTS))
def test_importing_a_removed_package_name_says_its_replacement(name: str) -> None:
    with pytest.raises(ImportError) as error:
        exec(f"from fsdp_conformance.adapters import {name}", {})  # noqa: S102
    line = _line_of(error)
    assert line.startswith(f"fsdp_conformance.adapters.{name} was removed: use "), line
    assert _removed.REMOVED_EXPORTS[name] in line and "Removed names" in line, line


def test_api_families_are_opt_in_through_declarations_api() -> None:
    """An adapter claims an API family only by naming its namespace; an unknown family is
    refused with the known ones."""
    import types

    plain = features.Declarations()
    assert Feature.FSDP2_API in plain.unsupported and Feature.FSDP1_API in plain.unsupported
    namespace = types.SimpleNamespace(fully_shard=lambda module, **kwargs: module)
    declaring = features.Declarations(api={"fsdp2": namespace})
    assert Feature.FSDP2_API not in declaring.unsupported
    assert "Declarations.api['fsdp1']" in declaring.unsupported[Feature.FSDP1_API]
    with pytest.raises(ValueError, match=r"unknown API families \['fsdp3'\]; use \['fsdp1', "):
        features.Declarations(api={"fsdp3": namespace})


def test_a_check_failure_travels_with_its_figure() -> None:
    import pickle

    from fsdp_conformance.checks import CheckFailure

    error = pickle.loads(pickle.dumps(CheckFailure("peak 6 > 3", "memory bound exceeded", peak=6)))
    assert (str(error), error.failure, error.figures) == (
        "peak 6 > 3",
        "memory bound exceeded",
        {"peak": 6},
    )
