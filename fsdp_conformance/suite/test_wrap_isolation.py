"""Two configurations in one process (``wrap.configs_isolated``): two ``nested`` models
differing on one axis (float32 vs bfloat16 unsharded parameters; FULL_SHARD vs SHARD_GRAD_OP),
both trained in one test, each behave by their own configuration and train as DDP: a
configuration cached per module class or process-wide fails (docs/suite.md).
"""

from __future__ import annotations

from typing import Any, ClassVar

import pytest
import torch

from fsdp_conformance.adapters import features as adapter_features
from fsdp_conformance.checks import CheckFailure
from fsdp_conformance.observe.unsharded import UnshardedParams

from . import test_parity, training
from .declare import check
from .test_memory import ALIVE, STEPS, observed_training, require_seen
from .training import parametrize

BF16 = {"param_dtype": torch.bfloat16, "reduce_dtype": torch.bfloat16}
# axis -> (first config, second config)
CONFIGS: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    "mixed_precision": ({}, {"mixed_precision": BF16}),
    "sharding": ({"sharding_strategy": "FULL_SHARD"}, {"sharding_strategy": "SHARD_GRAD_OP"}),
}


def _non_root_alive(probe: UnshardedParams) -> dict[str, list[str]]:
    return {
        label: names for label, names in probe.alive.items() if names and label != probe.root_label
    }


class BaseConfigIsolationTests:
    """Two models wrapped with different configurations each behave by their own."""

    axes: ClassVar[tuple[str, ...]] = tuple(CONFIGS)
    model: ClassVar[str] = "nested"

    def pytest_generate_tests(self, metafunc: pytest.Metafunc) -> None:
        parametrize(metafunc, axis=self.axes)

    @check(
        "wrap.configs_isolated",
        "two models wrapped in one process with different configurations (mixed precision, "
        "sharding) each behave by their own and train as DDP",
        case="the axis that differs: 'mixed_precision' or 'sharding'",
        case_of="axis",
    )
    @pytest.mark.world_size(2)
    def test_two_configs_in_one_process(self, fsdp_adapter: Any, dist: Any, axis: str):
        first, second = CONFIGS[axis]
        for config in (first, second):  # skip before wrapping either
            adapter_features.skip_unless(fsdp_adapter, *adapter_features.wrap_features(**config))
        models = [training.build(fsdp_adapter, self.model, dist, c) for c in (first, second)]
        probes, results = [], []
        for root, zoo_model in models:
            probe, losses = observed_training(fsdp_adapter, root, zoo_model, dist)
            probes.append(probe)
            results.append(training.TrainingResult(losses, fsdp_adapter.full_params(root)))
        reference = training.reference_run(self.model, dist, STEPS)
        labels = [
            f"adapter {fsdp_adapter.name!r}, {self.model} wrapped with {c or 'the defaults'} "
            f"({which} of two models wrapped with different {axis} in one process)"
            for c, which in zip((first, second), ("first", "second"))
        ]
        for label, probe in zip(labels, probes):
            require_seen(probe, label)
        if axis == "mixed_precision":
            for label, probe, dtype in zip(labels, probes, (torch.float32, torch.bfloat16)):
                other = {
                    f"{instance}: {name}": str(used)
                    for instance, names in probe.seen.items()
                    for name, used in names.items()
                    if used != dtype
                }
                assert not other, (
                    f"{label}: its forward used unsharded parameters in another dtype than "
                    f"its configuration's {dtype}: {other}"
                )
        else:
            if alive := _non_root_alive(probes[0]):
                raise CheckFailure(
                    f"{labels[0]}: FULL_SHARD reshards after forward, but after the forward "
                    f"these non-root instances still hold unsharded parameters: {alive}",
                    ALIVE,
                    instances=", ".join(sorted(alive)),
                )
            assert _non_root_alive(probes[1]), (
                f"{labels[1]}: SHARD_GRAD_OP keeps the unsharded parameters from forward to "
                "backward, but after the forward no non-root instance holds any (it was "
                "resharded as FULL_SHARD would be)"
            )
        bf16 = {"atol": test_parity.ATOL_BF16_PARAMS, "loss_rtol": test_parity.RTOL_BF16_LOSSES}
        tolerances = ({}, bf16 if axis == "mixed_precision" else {})
        for label, result, tolerance in zip(labels, results, tolerances):
            training.assert_same_training(label, result, reference, **tolerance)


class TestConfigIsolation(BaseConfigIsolationTests): ...
