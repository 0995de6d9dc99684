"""Forward through something other than the root's ``forward`` (collected by ``--pyargs``):
``forward.other_method``.

``BaseForwardMethodTests``, on ``loops`` (trunk owned by the root; blocks and head wrapped):

- ``method``: the loss comes from ``root.encode(x)`` (trunk and blocks, no head), a method
  registered with ``adapter.register_forward_method(root, "encode")`` (FSDP2
  ``register_fsdp_forward_method``, impl ``register_forward_method``);
- ``nested_alone``: every other step the loss comes from the wrapped head called alone
  (``head(x)``, not through the root), the steps between run the root's forward.

While the root's own parameters are in use (a forward pre-hook on the trunk) the root must hold
them unsharded; training states are legal at every hook (``TrainingStateRecorder``); after each
step no instance holds unsharded parameters (FULL_SHARD); losses and full parameters after
``STEPS`` SGD steps equal the unwrapped model's with its gradients averaged across ranks by hand
(DDP reduces only through its own forward), bit for bit: the same arithmetic as DDP.
"""

from __future__ import annotations

from typing import Any, ClassVar

import pytest
import torch

from fsdp_conformance.adapters import Feature
from fsdp_conformance.adapters import features as adapter_features
from fsdp_conformance.adapters import loop as adapter_loop
from fsdp_conformance.observe.states import TrainingStateRecorder

from . import verdict
from .loops import (
    Driver,
    LoopCase,
    _average_gradients,
    _parametrize,
    assert_losses,
    assert_params,
    build,
    build_reference,
    ddp_optimizer,
    fsdp_optimizer,
    micro_input,
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
        _parametrize(metafunc, variant=self.variants, strategy=self.strategies)

    @pytest.mark.world_size(2)
    def test_other_forward_method(self, fsdp_adapter: Any, dist: Any, variant: str, strategy: str):
        with verdict.cell(
            fsdp_adapter, "forward.other_method", LoopCase("loops", strategy, variant)
        ):
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
                _average_gradients(model, dist.group)
                reference_optimizer.step()
                reference_losses.append(loss.detach().float())
            assert_losses(label, torch.stack(losses), torch.stack(reference_losses))
            assert_params(
                label, Driver(root, zoo_model, adapter).params(), Driver(model, model).params(),
                self.STEPS,
            )  # fmt: skip


class TestForwardMethod(BaseForwardMethodTests):
    pass
