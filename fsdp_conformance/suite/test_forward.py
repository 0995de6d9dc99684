"""Forward through something other than the root's ``forward`` (``forward.other_method``), on
``loops``: a method registered with ``adapter.register_forward_method`` (``method``), and the
wrapped head called alone every other step (``nested_alone``). The root holds its own
parameters unsharded while they are used, states are legal at every hook, nothing stays
unsharded after a step (FULL_SHARD), and training matches DDP's arithmetic bit for bit.
docs/suite.md, "Optimizer groups, shared and ignored parameters, other forward methods".
"""

from __future__ import annotations

from typing import Any, ClassVar

import pytest
import torch

from fsdp_conformance.adapters import Feature
from fsdp_conformance.adapters import features as adapter_features
from fsdp_conformance.adapters import loop as adapter_loop
from fsdp_conformance.observe.states import TrainingStateRecorder

from .declare import check
from .loop_driver import (
    Driver,
    LoopCase,
    assert_losses,
    assert_params,
    average_gradients,
    build,
    build_reference,
    ddp_optimizer,
    fsdp_optimizer,
    micro_input,
    parametrize,
)


def _loss(zoo_model: Any, model: Any, variant: str, step: int, inputs: tuple) -> torch.Tensor:
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
        parametrize(metafunc, variant=self.variants, strategy=self.strategies)

    @check(
        "forward.other_method",
        "a registered method other than forward, and a nested instance's forward called alone: "
        "parameters unsharded while used, legal states, resharded after, matches DDP",
        case="suite.loop_driver.LoopCase",
        case_of=lambda variant, strategy: LoopCase("loops", strategy, variant),
    )
    @pytest.mark.world_size(2)
    def test_other_forward_method(self, fsdp_adapter: Any, dist: Any, variant: str, strategy: str):
        adapter = fsdp_adapter
        root, zoo_model = build(adapter, "loops", dist, {"sharding_strategy": strategy})
        if variant == "method":  # the nested instance alone needs no registration
            adapter_features.require(adapter, Feature.FORWARD_METHOD)
            adapter_loop.register_forward_method(adapter, root, "encode")
        label = f"adapter {adapter.name!r}, loops, {strategy}, {variant}"
        resident: list[str] = []
        step_of = [0]

        def root_params_in_use(module: Any, args: Any) -> None:
            if adapter_loop.is_unsharded(adapter, adapter.instances(root)[0]) is False:
                raise AssertionError(
                    f"{label}: the root's own parameters (the trunk's) are sharded while "
                    f"{'encode' if variant == 'method' else 'forward'} uses them (step "
                    f"{step_of[0]})"
                )

        hook = zoo_model.trunk.register_forward_pre_hook(root_params_in_use)
        optimizer = fsdp_optimizer(adapter, root)
        losses = []
        with TrainingStateRecorder(adapter, root) as recorder:
            for step in range(self.STEPS):
                step_of[0] = step
                optimizer.zero_grad()
                inputs = micro_input(zoo_model, dist.device, step)
                loss = _loss(zoo_model, root, variant, step, inputs)
                Driver(root, zoo_model, adapter).backward(loss)
                optimizer.step()
                losses.append(loss.detach().float())
                recorder.after_step()
                if strategy == "FULL_SHARD":
                    resident += [
                        f"step {step}: {type(adapter.unwrap(instance)).__name__}"
                        for instance in adapter.instances(root)
                        if adapter_loop.is_unsharded(adapter, instance)
                    ]
        hook.remove()
        recorder.assert_legal()
        assert not resident, f"{label}: unsharded parameters left after the step: {resident}"
        model, reference_model = build_reference("loops", dist, ddp=False)
        reference_optimizer = ddp_optimizer(model)
        reference_losses = []
        for step in range(self.STEPS):
            reference_optimizer.zero_grad()
            inputs = micro_input(reference_model, dist.device, step)
            loss = _loss(reference_model, model, variant, step, inputs)
            loss.backward()
            average_gradients(model, dist.group)
            reference_optimizer.step()
            reference_losses.append(loss.detach().float())
        assert_losses(label, torch.stack(losses), torch.stack(reference_losses))
        assert_params(
            label, Driver(root, zoo_model, adapter).params(), Driver(model, model).params(),
            self.STEPS,
        )  # fmt: skip


class TestForwardMethod(BaseForwardMethodTests):
    pass
