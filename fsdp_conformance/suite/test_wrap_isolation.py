"""Two configurations in one process (collected by ``--pyargs``).

``wrap.configs_isolated``: two copies of ``nested`` are wrapped in one process, one after the
other and before either runs, with configurations that differ on one axis; then both train
(``STEPS`` SGD+momentum steps each). Each must behave by its own configuration, whatever the
other one was wrapped with -- an implementation that caches per module class, or keeps its
configuration in process-wide state, hands the second model the first one's:

- ``mixed_precision``: the first model without mixed precision, the second with
  ``param_dtype = reduce_dtype = bfloat16``. The unsharded parameters each one's forward uses
  ([Note: unsharded parameters by value] in ``observe/unsharded.py``) are float32 in the first,
  bfloat16 in the second; the first trains bit-exact with DDP, the second within the
  ``parity.bf16`` tolerances (``parity.ATOL_BF16_PARAMS``, ``RTOL_BF16_LOSSES``).
- ``sharding``: the first FULL_SHARD, the second SHARD_GRAD_OP. After the forward no non-root
  instance of the first holds an unsharded parameter, while the second (which keeps them for
  backward by design) still holds some; both train bit-exact with DDP.

Both models are used in the same test: clearing a cache between tests (``on_test_end``) does
not make an implementation pass.
"""

from __future__ import annotations

from typing import Any, ClassVar

import pytest
import torch

from fsdp_conformance.adapters import features as adapter_features
from fsdp_conformance.adapters import loop as adapter_loop
from fsdp_conformance.observe.unsharded import UnshardedParams

from . import parity, training, verdict
from .loops import _parametrize
from .test_memory import STEPS, observed_training, unseen_instances

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
    """Two models wrapped with different configurations in one process each behave by their
    own (see the module docstring)."""

    axes: ClassVar[tuple[str, ...]] = tuple(CONFIGS)
    model: ClassVar[str] = "nested"

    def pytest_generate_tests(self, metafunc: pytest.Metafunc) -> None:
        _parametrize(metafunc, axis=self.axes)

    @pytest.mark.world_size(2)
    def test_two_configs_in_one_process(self, fsdp_adapter: Any, dist: Any, axis: str):
        with verdict.cell(fsdp_adapter, "wrap.configs_isolated", axis):
            adapter = fsdp_adapter
            first, second = CONFIGS[axis]
            for config in (first, second):  # skip before wrapping either
                adapter_features.skip_unless(
                    adapter, *adapter_features.wrap_features(adapter, **config)
                )
            models = [training.wrap_model(adapter, self.model, dist, c) for c in (first, second)]
            probes, results = [], []
            for root, zoo_model in models:
                probe, losses = observed_training(adapter, root, zoo_model, dist)
                probes.append(probe)
                results.append(
                    training.TrainingResult(losses, adapter_loop.full_params(adapter, root))
                )
            reference = training.reference_run(self.model, dist, STEPS)
            labels = [
                f"adapter {adapter.name!r}, {self.model} wrapped with {c or 'the defaults'} "
                f"({which} of two models wrapped with different {axis} in one process)"
                for c, which in zip((first, second), ("first", "second"))
            ]
            for label, probe in zip(labels, probes):
                unseen = unseen_instances(probe)
                assert not unseen, (
                    f"{label}: no unsharded parameter was recognised in the forward of "
                    f"instance(s) {unseen}; the check cannot see this implementation's parameters"
                )
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
                training.assert_same_training(labels[0], results[0], reference)
                training.assert_same_training(
                    labels[1],
                    results[1],
                    reference,
                    atol=parity.ATOL_BF16_PARAMS,
                    loss_atol=0.0,
                    loss_rtol=parity.RTOL_BF16_LOSSES,
                )
            else:
                alive = _non_root_alive(probes[0])
                assert not alive, (
                    f"{labels[0]}: FULL_SHARD reshards after forward, but after the forward these "
                    f"non-root instances still hold unsharded parameters: {alive}"
                )
                assert _non_root_alive(probes[1]), (
                    f"{labels[1]}: SHARD_GRAD_OP keeps the unsharded parameters from forward to "
                    "backward, but after the forward no non-root instance holds any (it was "
                    "resharded as FULL_SHARD would be)"
                )
                for label, result in zip(labels, results):
                    training.assert_same_training(label, result, reference)


class TestConfigIsolation(BaseConfigIsolationTests):
    pass
