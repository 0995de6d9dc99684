"""Resharding after forward (``memory.reshard_after_forward``): with FULL_SHARD no unsharded
parameter of a non-root instance stays alive once the model's forward has returned; seen by
value and weak reference (``observe/unsharded.py``). SHARD_GRAD_OP keeps them by design.
"""

from __future__ import annotations

import contextlib
from typing import Any, ClassVar

import pytest
import torch
from torch import nn

from fsdp_conformance.adapters import Adapter
from fsdp_conformance.checks import CheckFailure
from fsdp_conformance.observe.unsharded import UnshardedParams

from . import training
from .declare import check
from .training import LoopCase, parametrize

# the last step's forward is observed (the first runs any lazy init)
STEPS = 2
ALIVE = "unsharded parameters alive after forward"  # figure: the instances


def observed_training(
    adapter: Adapter, root: nn.Module, zoo_model: nn.Module, dist: Any
) -> tuple[UnshardedParams, torch.Tensor]:
    """Train `root` ``STEPS`` steps, observing the last forward's unsharded parameters;
    returns the probe (``seen``, ``alive``) and the losses."""
    probes: list[UnshardedParams] = []

    def loss(step: int, index: int) -> torch.Tensor:
        inputs = zoo_model.get_input(dist.device)
        if step == STEPS - 1:
            probes.append(UnshardedParams(adapter, root, adapter.full_params(root)))
        with probes[0] if probes else contextlib.nullcontext():
            output = root(*inputs)
        return zoo_model.get_loss(inputs, output)

    losses = training.train(root, zoo_model, dist.device, STEPS, adapter, loss=loss)
    return probes[0], losses


def require_seen(probe: UnshardedParams, label: str, how: str = "") -> None:
    """``CheckFailure`` "no unsharded parameter recognised" (``instances``) naming the non-root
    instances in whose forward none was (a check that sees nothing must not pass)."""
    unseen = [
        name
        for name in probe.labels.values()
        if name != probe.root_label and not probe.seen.get(name)
    ]
    if unseen:
        raise CheckFailure(
            f"{label}: no unsharded parameter was recognised in the forward of instance(s) "
            f"{unseen}{how}; the check cannot see this implementation's parameters",
            "no unsharded parameter recognised",
            instances=", ".join(unseen),
        )


class BaseReshardAfterForwardTests:
    """No unsharded parameter of a non-root instance is alive after the forward (FULL_SHARD);
    every non-root instance must have been seen using one."""

    models: ClassVar[tuple[str, ...]] = ("nested", "transformer")

    def pytest_generate_tests(self, metafunc: pytest.Metafunc) -> None:
        parametrize(metafunc, model_name=self.models)

    @check(
        "memory.reshard_after_forward",
        "with resharding after forward configured (FULL_SHARD), no unsharded parameter of a "
        "non-root instance stays alive after the model's forward",
        case="suite.training.LoopCase",
        case_of=lambda model_name: LoopCase(model_name, "FULL_SHARD", "reshard_after_forward"),
    )
    @pytest.mark.world_size(2)
    def test_no_unsharded_parameter_after_forward(
        self, fsdp_adapter: Any, dist: Any, model_name: str
    ):
        adapter = fsdp_adapter
        root, zoo_model = training.build(
            adapter, model_name, dist, {"sharding_strategy": "FULL_SHARD"}
        )
        probe, _ = observed_training(adapter, root, zoo_model, dist)
        label = f"adapter {adapter.name!r}, {model_name}, FULL_SHARD"
        require_seen(
            probe, label, " (tensors equal to a full parameter, given to a torch function)"
        )
        alive = {name: names for name, names in probe.alive.items() if names}
        alive.pop(probe.root_label, None)
        if alive:
            raise CheckFailure(
                f"{label}: resharding after forward is configured, but after the model's "
                f"forward these non-root instances still hold unsharded parameters (alive, "
                f"storage not freed): {alive}",
                ALIVE,
                instances=", ".join(sorted(alive)),
            )


class TestReshardAfterForward(BaseReshardAfterForwardTests):
    pass
