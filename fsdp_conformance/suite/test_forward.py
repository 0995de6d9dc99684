"""Forward through something other than the root's ``forward`` (``forward.other_method``):
a method registered with ``adapter.register_forward_method``, and the wrapped head called alone
every other step. Parameters unsharded while used, legal states, nothing unsharded after a
FULL_SHARD step, training as DDP bit for bit (docs/suite.md).
"""

from __future__ import annotations

from typing import Any, ClassVar

import pytest
import torch

from fsdp_conformance.adapters import Feature
from fsdp_conformance.adapters import features as adapter_features
from fsdp_conformance.observe.states import TrainingStateRecorder

from . import training
from .declare import check


def _loss(driver: training.Driver, variant: str, step: int, index: int) -> torch.Tensor:
    zoo_model, model = driver.zoo_model, driver.model
    inputs = training.micro_input(zoo_model, driver.device, index)
    if variant == "method":
        return model.encode(*inputs).square().sum()
    if step % 2 == 1:  # the head alone, on a (B, 16) input
        return zoo_model.head(torch.tanh(inputs[0].repeat(1, 2))).square().sum()
    return zoo_model.get_loss(inputs, model(*inputs))


class BaseForwardMethodTests:
    """A registered method other than forward, and a nested instance's forward called alone."""

    STEPS: ClassVar[int] = 4
    variants: ClassVar[tuple[str, ...]] = ("method", "nested_alone")
    strategies: ClassVar[tuple[str, ...]] = ("FULL_SHARD", "SHARD_GRAD_OP")

    def pytest_generate_tests(self, metafunc: pytest.Metafunc) -> None:
        training.parametrize(metafunc, variant=self.variants, strategy=self.strategies)

    @check(
        "forward.other_method",
        "a registered method other than forward, and a nested instance's forward called alone: "
        "parameters unsharded while used, legal states, resharded after, matches DDP",
        case="suite.training.LoopCase",
        case_of=lambda variant, strategy: training.LoopCase("loops", strategy, variant),
        api=("register_fsdp_forward_method()",),  # through torch-fsdp2
    )
    @pytest.mark.world_size(2)
    def test_other_forward_method(self, fsdp_adapter: Any, dist: Any, variant: str, strategy: str):
        driver = training.fsdp_driver(fsdp_adapter, "loops", dist, {"sharding_strategy": strategy})
        root, zoo_model = driver.model, driver.zoo_model
        if variant == "method":  # the nested instance alone needs no registration
            adapter_features.require(fsdp_adapter, Feature.FORWARD_METHOD)
            fsdp_adapter.register_forward_method(root, "encode")
        label = f"adapter {fsdp_adapter.name!r}, loops, {strategy}, {variant}"
        resident: list[str] = []
        step_of = [0]  # the step running

        def root_params_in_use(module: Any, args: Any) -> None:
            if fsdp_adapter.is_unsharded(fsdp_adapter.instances(root)[0]) is False:
                raise AssertionError(
                    f"{label}: the root's own parameters (the trunk's) are sharded while "
                    f"{'encode' if variant == 'method' else 'forward'} uses them (step "
                    f"{step_of[0]})"
                )

        def after_step(step: int) -> None:
            step_of[0] = step + 1
            recorder.after_step()
            if strategy == "FULL_SHARD":
                resident.extend(training.unsharded(fsdp_adapter, root, step))

        hook = zoo_model.trunk.register_forward_pre_hook(root_params_in_use)
        with TrainingStateRecorder(fsdp_adapter, root) as recorder:
            loss = lambda step, index: _loss(driver, variant, step, index)
            losses = driver.run(self.STEPS, loss=loss, after_step=after_step)
        hook.remove()
        recorder.assert_legal()
        assert not resident, f"{label}: unsharded parameters left after the step: {resident}"
        reference = training.ddp_driver("loops", dist, ddp=False)
        reference_losses = reference.run(
            self.STEPS,
            loss=lambda step, index: _loss(reference, variant, step, index),
            after_backward=lambda step: training.average_gradients(reference.model, dist.group),
        )
        expected = (reference_losses, reference.params())
        training.assert_trained(label, (losses, driver.params()), expected, self.STEPS)


class TestForwardMethod(BaseForwardMethodTests): ...
