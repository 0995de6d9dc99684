"""What wrapping promises about parameters outside the one-owner case: a parameter shared by
two instances (``wrap.shared_across_instances``) and ignored parameters (``wrap.ignored``);
docs/suite.md, "Optimizer groups, shared and ignored parameters, other forward methods".
"""

from __future__ import annotations

import re
from typing import Any, ClassVar

import pytest
import torch
from torch import nn

from fsdp_conformance.adapters import UnsupportedFeatureError
from fsdp_conformance.models import DeviceInit, move_after_wrap

from . import training, zoo
from .declare import check

# an error that names the shared parameter: its attribute name and one of its modules
_NAMES_SHARED = re.compile(r"\bweight\b.*\b(embed|head|Embedding|Linear)|(embed|head)\.weight")


class BaseSharedParamsTests:
    """An embedding's weight tied to a head's, the two wrapped apart: a clear error naming it
    (at wrap or the first forward), or training as DDP (trained untied, it diverges)."""

    model: ClassVar[str] = "tied_instances"
    strategies: ClassVar[tuple[str, ...]] = ("FULL_SHARD", "SHARD_GRAD_OP")

    def pytest_generate_tests(self, metafunc: pytest.Metafunc) -> None:
        training.parametrize(metafunc, strategy=self.strategies)

    @check(
        "wrap.shared_across_instances",
        "one parameter used by two instances (tied embedding and head wrapped apart): a clear "
        "error at wrap naming the parameter, or training that matches DDP",
        case="suite.training.LoopCase",
        case_of=lambda self, strategy: training.LoopCase(self.model, strategy, "tied_apart"),
    )
    @pytest.mark.world_size(2)
    def test_shared_parameter_across_instances(self, fsdp_adapter: Any, dist: Any, strategy: str):
        label = (
            f"adapter {fsdp_adapter.name!r}, {self.model} (embed.weight is head.weight, the two "
            f"wrapped apart), {strategy}"
        )
        config = {"sharding_strategy": strategy}
        try:
            root, zoo_model = training.build(fsdp_adapter, self.model, dist, config)
            with torch.no_grad():  # the root's lazy init (FSDP2 checks parameters there)
                root(*zoo_model.get_input(dist.device))
        except UnsupportedFeatureError:
            raise
        except Exception as error:  # noqa: BLE001 -- a refusal of any type is allowed
            message = f"{type(error).__name__}: {error}"
            assert _NAMES_SHARED.search(message), (
                f"{label}: wrapping failed with {message!r}, which does not name the shared "
                "parameter (e.g. 'head.weight', shared with 'embed')"
            )
            return
        losses = training.train(root, zoo_model, dist.device, adapter=fsdp_adapter)
        result = training.TrainingResult(losses, fsdp_adapter.full_params(root))
        label += ": the wrap was accepted, so training must match DDP"
        training.assert_same_training(label, result, training.reference_run(self.model, dist))


class TestSharedParams(BaseSharedParamsTests): ...


# the ignored parameters: block 1's Linear (inside a block the auto_wrap variant wraps)
IGNORED = "blocks.1.0."


def _ignored(model: nn.Module) -> dict[str, nn.Parameter]:
    return {name: p for name, p in model.named_parameters() if name.startswith(IGNORED)}


def _ignored_run(driver: training.Driver, dist: Any, steps: int, ignored: dict):
    """(losses, the ignored parameters' gradients after the first backward, full parameters);
    the reference (no adapter) averages every gradient but the ignored ones."""
    first_grads = {}

    def after_backward(step: int) -> None:
        if step == 0:
            first_grads.update({name: p.grad.clone() for name, p in ignored.items()})
        if driver.adapter is None:
            saved = {name: p.grad for name, p in ignored.items()}
            for p in ignored.values():
                p.grad = None
            training.average_gradients(driver.zoo_model, dist.group)
            for name, p in ignored.items():
                p.grad = saved[name]

    losses = driver.run(steps, after_backward=after_backward)
    return losses, first_grads, driver.params()


class BaseIgnoredParamsTests:
    """Ignored parameters, alone or inside an auto-wrapped block: registered whole on every
    rank, unreduced, in the state dict under their names; the rest trains as DDP."""

    STEPS: ClassVar[int] = 3
    variants: ClassVar[tuple[str, ...]] = ("alone", "auto_wrap")
    strategies: ClassVar[tuple[str, ...]] = ("FULL_SHARD", "SHARD_GRAD_OP")

    def pytest_generate_tests(self, metafunc: pytest.Metafunc) -> None:
        training.parametrize(metafunc, variant=self.variants, strategy=self.strategies)

    @check(
        "wrap.ignored",
        "ignored parameters, alone and under an auto-wrap policy: registered whole on every rank, "
        "not reduced, in the state dict under their keys; the rest trains as DDP",
        features=("ignored_params",),
        case="suite.training.LoopCase",
        case_of=lambda variant, strategy: training.LoopCase("loops", strategy, variant),
        # through torch-fsdp1 and torch-fsdp2
        api=(
            "FullyShardedDataParallel(ignored_states=Iterable[Parameter])",
            "fully_shard(ignored_params)",
        ),
    )
    @pytest.mark.world_size(2)
    def test_ignored_params(self, fsdp_adapter: Any, dist: Any, variant: str, strategy: str):
        zoo_model = zoo.build("loops", dist.group, None, dist.device)
        ignored = _ignored(zoo_model)
        config: dict[str, Any] = {
            "sharding_strategy": strategy,
            "ignored_params": tuple(ignored.values()),
        }
        if variant == "auto_wrap":
            targets = [*zoo_model.blocks, zoo_model.head]
            config["auto_wrap_policy"] = lambda module: any(module is t for t in targets)
        root = fsdp_adapter.wrap(zoo_model, process_group=dist.group, root=True, **config)
        root = move_after_wrap(root, DeviceInit.AFTER, dist.device)
        label = f"adapter {fsdp_adapter.name!r}, loops, {strategy}, {IGNORED}* ignored, {variant}"
        registered = training.by_clean_name(fsdp_adapter, root.named_parameters())
        for name, param in ignored.items():
            seen = registered.get(name)
            assert seen is param and type(seen) is nn.Parameter, (
                f"{label}: ignored parameter {name!r} is not registered under its name as "
                f"the same nn.Parameter (found {type(seen).__name__}"
                f"{'' if seen is None else tuple(seen.shape)})"
            )
        driver = training.Driver(root, zoo_model, dist.device, fsdp_adapter)
        losses, grads, params = _ignored_run(driver, dist, self.STEPS, ignored)
        reference = training.ddp_driver("loops", dist, ddp=False)
        ref_losses, ref_grads, ref_params = _ignored_run(
            reference, dist, self.STEPS, _ignored(reference.model)
        )
        for name, grad in grads.items():
            assert torch.equal(grad, ref_grads[name]), (
                f"{label}: the gradient of ignored parameter {name!r} after the first "
                "backward is not this rank's own (the implementation reduced it?): max "
                f"|difference| {(grad - ref_grads[name]).abs().max().item():.3g}"
            )
        state = fsdp_adapter.state_dict(root)
        for name, param in ignored.items():
            assert name in state and torch.equal(state[name], param.detach()), (
                f"{label}: the full state dict does not hold ignored parameter {name!r} "
                f"under its own key with its value (keys: {sorted(state)})"
            )
        training.assert_trained(label, (losses, params), (ref_losses, ref_params), self.STEPS)


class TestIgnoredParams(BaseIgnoredParamsTests): ...
