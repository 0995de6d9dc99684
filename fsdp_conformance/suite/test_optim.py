"""Optimizer parameter groups as users write them (``optim.param_groups``): AdamW without
weight decay on biases and norms and one block at a tenth of the learning rate, chosen by the
unwrapped model's names, trains bit for bit as DDP with the same groups (docs/suite.md).
"""

from __future__ import annotations

from typing import Any, ClassVar

import pytest
import torch
from torch import nn

from fsdp_conformance.adapters import Feature
from fsdp_conformance.adapters import features as adapter_features
from fsdp_conformance.adapters.base import group_by

from . import training
from .declare import check

ADAMW_LR = 1e-2
WEIGHT_DECAY = 0.1
# the block trained at a tenth of the learning rate
SLOW_BLOCK = "blocks.1."


def group_options(name: str, param: nn.Parameter) -> dict[str, Any]:
    """The groups users write: no weight decay on biases and norms, one block slower. By name
    only: FSDP1 (use_orig_params) and impl hand the optimizer one-dimensional pieces."""
    options: dict[str, Any] = {}
    if name.endswith("bias") or ".norm" in name:
        options["weight_decay"] = 0.0
    if name.startswith(SLOW_BLOCK):
        options["lr"] = ADAMW_LR / 10
    return options


def reference_groups(model: nn.Module) -> list[dict[str, Any]]:
    """``group_options``' groups over the unwrapped model, for torch's AdamW under DDP."""
    return group_by(model.named_parameters(), group_options)


class BaseParamGroupTests:
    """Parameter groups by name (feature ``param_groups``) train as DDP with the same groups."""

    STEPS: ClassVar[int] = 3
    models: ClassVar[tuple[str, ...]] = ("loops_norm",)
    strategies: ClassVar[tuple[str, ...]] = ("FULL_SHARD", "SHARD_GRAD_OP")

    def pytest_generate_tests(self, metafunc: pytest.Metafunc) -> None:
        training.parametrize(metafunc, model_name=self.models, strategy=self.strategies)

    @check(
        "optim.param_groups",
        "optimizer parameter groups by name (no weight decay on biases and norms, one block at "
        "another learning rate): AdamW matches DDP",
        features=("param_groups",),
        case="suite.training.LoopCase",
        case_of=lambda model_name, strategy: training.LoopCase(
            model_name, strategy, "adamw_groups"
        ),
        api=("FullyShardedDataParallel(use_orig_params=True)",),
    )
    @pytest.mark.world_size(2)
    def test_param_groups_match_ddp(
        self, fsdp_adapter: Any, dist: Any, model_name: str, strategy: str
    ):
        config: dict[str, Any] = {"sharding_strategy": strategy}
        if adapter_features.supports(fsdp_adapter, Feature.USE_ORIG_PARAMS):  # FSDP1 needs it
            config["use_orig_params"] = True
        driver = training.fsdp_driver(fsdp_adapter, model_name, dist, config)
        adamw = {"lr": ADAMW_LR, "weight_decay": WEIGHT_DECAY}
        driver.optimizer = fsdp_adapter.optimizer(
            driver.model, "adamw", param_groups=group_options, **adamw
        )
        losses = driver.run(self.STEPS)
        reference = training.ddp_driver(model_name, dist)
        reference.optimizer = torch.optim.AdamW(reference_groups(reference.zoo_model), **adamw)
        label = (
            f"adapter {fsdp_adapter.name!r}, {model_name}, {strategy}, AdamW with groups (no "
            f"weight decay on biases and norms, lr/10 for {SLOW_BLOCK}*)"
        )
        expected = (reference.run(self.STEPS), reference.params())
        training.assert_trained(label, (losses, driver.params()), expected, self.STEPS)


class TestParamGroups(BaseParamGroupTests): ...
