"""The protocol fits an implementation not shaped like FSDP1 (no false failures).

An outside adapter (``engine_like:ADAPTER``, written by pytester) reproduces each gap the
DeepSpeed adapter met: it owns its optimizer and backward (backward refuses to run unless the
suite asked the adapter for the optimizer), needs to know the root at wrap time (``_wrap``
refuses ``root=None``), sums gradients across ranks (``grad_reduction="sum"``: its backward
scales the loss by the world size) and keeps no per-instance training state
(``instance_states=False``); it must pass every one of these cells. The coverage test checks
that the pairwise set is built over the values an adapter supports.
"""

from __future__ import annotations

import itertools
import textwrap

import pytest

from fsdp_conformance.adapters import Adapter, Declarations, Feature, get_adapter
from fsdp_conformance.adapters import features as adapter_features
from fsdp_conformance.suite import configs

pytest_plugins = ["pytester"]

_ADAPTER = """
import dataclasses

import torch

from fsdp_conformance.adapters.impl import ImplAdapter


class EngineLike(ImplAdapter):
    name = "engine-like"
    declarations = dataclasses.replace(
        ImplAdapter.declarations, instance_states=False, grad_reduction="sum"
    )

    def _wrap(self, module, process_group, config):
        if self.wrapping_root is None:
            raise RuntimeError("engine-like: wrap was not told whether this call is the root")
        wrapped = super()._wrap(module, process_group, config)
        wrapped._engine_root = self.wrapping_root
        return wrapped

    def training_state(self, instance):
        raise ValueError("engine-like keeps no per-instance training state")

    def optimizer(self, model, name="sgd", **hyperparameters):
        assert model._engine_root, "engine-like: the optimizer belongs to the root engine"
        model._engine_optimizer = super().optimizer(model, name, **hyperparameters)
        return model._engine_optimizer

    def backward(self, model, loss):
        if getattr(model, "_engine_optimizer", None) is None:
            raise RuntimeError("engine-like: backward before the adapter built the optimizer")
        # gradients summed across ranks (impl averages them): the suite divides the loss
        (loss * torch.distributed.get_world_size()).backward()


ADAPTER = EngineLike()
"""

_CHECKS = """
from fsdp_conformance.suite import BaseDDPParityTests, BaseTrainingStateTests


class TestParity(BaseDDPParityTests):
    models = ("nested",)
    world_sizes = (2,)
    coverage = "pairwise"
    mixed_precision_models = ()


class TestStates(BaseTrainingStateTests):
    models = ("nested",)
    backward_prefetches = (None,)
"""


def test_engine_like_outside_adapter_passes(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(engine_like=textwrap.dedent(_ADAPTER), test_checks=_CHECKS)
    result = pytester.runpytest_subprocess(
        "-p",
        "no:cacheprovider",
        "--fsdp-impl",
        "engine_like:ADAPTER",
        "-k",
        "test_matches_ddp or test_states_are_legal",
        timeout=600,
    )
    outcomes = result.parseoutcomes()
    assert outcomes.get("failed", 0) == 0 and outcomes.get("errors", 0) == 0, result.stdout.str()
    # 15 pairwise parity configs + 3 state cases, none skipped (impl has every feature)
    assert outcomes.get("passed", 0) == 18, outcomes


class _NoBackwardPre(Adapter):
    name = "no-backward-pre"
    declarations = Declarations(
        unsupported={
            Feature.BACKWARD_PREFETCH_PRE: "none",
            Feature.NO_SHARD: "none",
            Feature.CPU_OFFLOAD: "none",
        }
    )


def test_coverage_pairs_the_values_the_adapter_has() -> None:
    dimensions = configs.supported_dimensions(_NoBackwardPre())
    assert dimensions["backward_prefetch"] == (None, "BACKWARD_POST")
    assert dimensions["sharding_strategy"] == ("FULL_SHARD", "SHARD_GRAD_OP")
    assert dimensions["cpu_offload"] == (False,)
    chosen = configs.pairwise(dimensions)
    for (a, values_a), (b, values_b) in itertools.combinations(dimensions.items(), 2):
        for value_a, value_b in itertools.product(values_a, values_b):
            assert any(c[a] == value_a and c[b] == value_b for c in chosen), (
                a,
                value_a,
                b,
                value_b,
            )
    # every config is runnable: nothing built around a value the adapter lacks
    adapter = _NoBackwardPre()
    for config in chosen:
        wrap_config = {k: v for k, v in config.items() if k != "device_init" and v is not None}
        assert adapter_features.supports(adapter, *adapter_features.wrap_features(**wrap_config)), (
            config
        )


def test_fairscale_coverage_skips_nothing_for_a_missing_value() -> None:
    dimensions = configs.supported_dimensions(get_adapter("fairscale"))
    if adapter_features.why_unsupported(get_adapter("fairscale"), Feature.FULL_SHARD) is not None:
        pytest.skip("fairscale is not installed")
    assert dimensions["backward_prefetch"] == (None,)
    assert "NO_SHARD" not in dimensions["sharding_strategy"]
