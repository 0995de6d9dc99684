"""Train FSDP (`fsdp_run`) and DDP (`reference_run`, cached per rank process), compare
(`assert_same_training`): torch's `_test_identical_outputs`, adapter-driven. Both alternate
``zero_grad(set_to_none=...)`` (True in step 0).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from fsdp_conformance.adapters import Adapter
from fsdp_conformance.adapters import features as adapter_features
from fsdp_conformance.models import DeviceInit, DummyDDP, move_after_wrap

from . import zoo

STEPS = 3
LR = 0.01
MOMENTUM = 0.9


@dataclasses.dataclass
class TrainingResult:
    """What one training run produced."""

    losses: torch.Tensor  # (steps,) fp32
    # full parameters after the last step by the unwrapped model's names (tied: under each)
    params: dict[str, torch.Tensor]
    # per step, the gradients after backward: DDP's full ones or `Adapter.grad_shards`; None:
    # the adapter does not read them
    grads: list[dict[str, Any]] | None = None


def train(
    model: nn.Module,
    zoo_model: nn.Module,
    device: torch.device,
    steps: int = STEPS,
    after_backward: Callable[[int], None] | None = None,
    after_step: Callable[[int], None] | None = None,
    adapter: Adapter | None = None,
    around_forward: Callable[[int], contextlib.AbstractContextManager[Any]] | None = None,
    phase: Callable[[int], contextlib.AbstractContextManager[None]] | None = None,
) -> torch.Tensor:
    """`steps` SGD+momentum steps of `model` (a wrapped `zoo_model`); the fp32 losses.
    `adapter`: the one that wrapped `model` (its optimizer and backward; None: torch's); the
    hooks get the step; `around_forward(step)` / `phase(step)`: context managers the step's
    forward / forward and backward run in."""
    if adapter is None:
        optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    else:
        optimizer = adapter.optimizer(model, "sgd", lr=LR, momentum=MOMENTUM)
    losses = []
    for step in range(steps):
        optimizer.zero_grad(set_to_none=step % 2 == 0)
        with contextlib.nullcontext() if phase is None else phase(step):
            inputs = zoo_model.get_input(device)
            with around_forward(step) if around_forward else contextlib.nullcontext():
                output = model(*inputs)
            loss = zoo_model.get_loss(inputs, output)
            if adapter is None:
                zoo_model.run_backward(loss)
            else:
                zoo_model.run_backward(loss, functools.partial(adapter_backward, adapter, model))
        if after_backward is not None:
            after_backward(step)
        optimizer.step()
        if after_step is not None:
            after_step(step)
        losses.append(loss.detach().float())
    return torch.stack(losses)


def adapter_backward(adapter: Adapter, model: nn.Module, loss: torch.Tensor) -> None:
    """Backward of `loss` through `adapter`. Under ``grad_reduction == "sum"`` the loss is
    divided by the root's group size and an instance on a group of another size (the MoE
    expert) has its gradients scaled by root size / own size (a hook: linear, so before or after
    the reduction alike): summed gradients then equal DDP's averaged ones."""
    if adapter.declarations.grad_reduction != "sum":
        adapter.backward(model, loss)
        return
    instances = adapter.instances(model)
    root_size = adapter.group_size(instances[0] if instances else model)
    handles = []
    for instance in instances[1:]:
        factor = root_size / adapter.group_size(instance)
        if factor != 1:
            for param in own_parameters(instances, instance):
                if param.requires_grad:
                    handles.append(param.register_hook(lambda grad, f=factor: grad * f))
    try:
        adapter.backward(model, loss / root_size)
    finally:
        for handle in handles:
            handle.remove()


def own_parameters(instances: list[nn.Module], instance: nn.Module) -> list[torch.Tensor]:
    """The parameters `instance` registers itself: in its tree, outside the other `instances`
    nested in it (flat parameters, DTensor shards, parametrization originals)."""
    nested = {id(other) for other in instances if other is not instance}
    params, stack = [], [instance]
    while stack:
        module = stack.pop()
        params.extend(p for p in module._parameters.values() if p is not None)
        stack.extend(child for child in module.children() if id(child) not in nested)
    return params


# (model, rank, world size, device, steps) -> result; per rank process (and per rank thread)
_reference_cache: dict[tuple, TrainingResult] = {}


def reference_run(model_name: str, dist: Any, steps: int = STEPS) -> TrainingResult:
    """The unwrapped model trained under DDP (DummyDDP for self-reducing models), cached."""
    key = (model_name, dist.rank, dist.world_size, str(dist.device), steps)
    if key not in _reference_cache:
        model = zoo.build(model_name, dist.group, None, dist.device)
        model.to(dist.device)
        if zoo.MODELS[model_name].reference == "dummy_ddp":
            wrapped: nn.Module = DummyDDP(model)
        else:
            wrapped = nn.parallel.DistributedDataParallel(model, process_group=dist.group)
        grads: list[dict[str, Any]] = []

        def record_grads(step: int) -> None:
            named = model.named_parameters(remove_duplicate=False)
            grads.append({n: p.grad.detach().clone() for n, p in named if p.grad is not None})

        losses = train(wrapped, model, dist.device, steps, after_backward=record_grads)
        params = {n: p.detach().clone() for n, p in model.named_parameters(remove_duplicate=False)}
        _reference_cache[key] = TrainingResult(losses, params, grads)
    return _reference_cache[key]


def wrap_model(
    adapter: Adapter,
    model_name: str,
    dist: Any,
    config: dict[str, Any],
    device_init: str = "after",
) -> tuple[nn.Module, nn.Module]:
    """The zoo model wrapped by `adapter` with `config`: (root, zoo model). Skips when the
    adapter lacks a feature the config or the model needs."""
    adapter_features.skip_unless(adapter, *zoo.MODELS[model_name].features)
    adapter_features.skip_unless(adapter, *adapter_features.wrap_features(**config))
    zoo_model = zoo.build(
        model_name, dist.group, adapter.wrapper(**config), dist.device, device_init
    )
    root_config = {**config, **zoo_model.ROOT_WRAP_CONFIG}
    adapter_features.skip_unless(adapter, *adapter_features.wrap_features(**root_config))
    if DeviceInit(device_init) is DeviceInit.NEVER and dist.device.type != "cpu":
        root_config.setdefault("device_id", dist.device)  # the implementation moves it
    root = adapter.wrap(zoo_model, root=True, **root_config)
    return move_after_wrap(root, DeviceInit(device_init), dist.device), zoo_model


def fsdp_run(
    adapter: Adapter,
    model_name: str,
    dist: Any,
    config: dict[str, Any],
    device_init: str = "after",
    steps: int = STEPS,
) -> TrainingResult:
    """The zoo model wrapped by `adapter` with `config`, trained `steps` steps."""
    root, zoo_model = wrap_model(adapter, model_name, dist, config, device_init)
    return fsdp_train(adapter, root, zoo_model, dist, steps)


def fsdp_train(
    adapter: Adapter,
    root: nn.Module,
    zoo_model: nn.Module,
    dist: Any,
    steps: int = STEPS,
    phase: Callable[[int], contextlib.AbstractContextManager[None]] | None = None,
) -> TrainingResult:
    """Train a wrapped root `steps` steps, with its gradient shards after every backward."""
    grads: list[Any] = []

    def record_grads(step: int) -> None:
        shards = adapter.grad_shards(root)
        if shards is not None:
            shards = {name: (start, values.clone()) for name, (start, values) in shards.items()}
        grads.append(shards)

    losses = train(root, zoo_model, dist.device, steps, record_grads, adapter=adapter, phase=phase)
    readable = all(shards is not None for shards in grads)
    params = adapter.full_params(root)
    return TrainingResult(losses, params, grads if readable else None)


def assert_same_training(
    label: str,
    actual: TrainingResult,
    expected: TrainingResult,
    atol: float = 0.0,
    rtol: float = 0.0,
    loss_rtol: float | None = None,
) -> None:
    """Equal losses, gradient shards and full parameters (bit-exact at tolerances 0); `label`
    names the run; `atol`, `rtol` hold for the losses too unless `loss_rtol` (absolute 0)."""
    loss_atol, loss_rtol = (atol, rtol) if loss_rtol is None else (0.0, loss_rtol)
    missing = set(expected.params) - set(actual.params)
    extra = set(actual.params) - set(expected.params)
    if missing or extra:
        raise AssertionError(
            f"{label}: full parameter names differ from DDP's: missing {sorted(missing)}, "
            f"unexpected {sorted(extra)}"
        )
    detail = f"FSDP losses {actual.losses.tolist()}, DDP losses {expected.losses.tolist()}"
    if actual.losses.shape != expected.losses.shape:
        raise AssertionError(f"{label}: {len(actual.losses)} losses, DDP {len(expected.losses)}")
    for step in range(len(expected.losses)):
        assert_close(
            f"{label}: losses differ from DDP's at step {step} "
            f"({tolerance_text(loss_atol, loss_rtol)})",
            actual.losses[step],
            expected.losses[step],
            loss_atol,
            loss_rtol,
            detail=detail,
        )
        if actual.grads is not None and expected.grads is not None:
            full = expected.grads[step]
            for name, (start, values) in actual.grads[step].items():
                if name not in full:
                    raise AssertionError(
                        f"{label}: after step {step}'s backward the FSDP run holds a gradient "
                        f"of {name!r}, DDP has none (DDP's: {sorted(full)})"
                    )
                assert_close(
                    f"{label}: after step {step}'s backward, this rank's gradient shard of "
                    f"{name!r} (elements {start}..{start + values.numel()} of the flattened "
                    f"parameter) differs from DDP's gradient there ({tolerance_text(atol, rtol)})",
                    values,
                    full[name].reshape(-1)[start : start + values.numel()],
                    atol,
                    rtol,
                )
    for name, reference in expected.params.items():
        assert_close(
            f"{label}: parameter {name!r} differs from DDP's after {len(expected.losses)} "
            f"steps ({tolerance_text(atol, rtol)})",
            actual.params[name],
            reference,
            atol,
            rtol,
        )


def tolerance_text(atol: float, rtol: float) -> str:
    return "bit-exact" if atol == rtol == 0 else f"atol={atol:g}, rtol={rtol:g}"


def assert_close(
    message: str,
    actual: torch.Tensor,
    expected: torch.Tensor,
    atol: float,
    rtol: float,
    detail: str = "",
) -> None:
    """AssertionError ``message: max |difference| ...`` unless close (equal when both are 0)."""
    actual = actual.detach().float().cpu()
    expected = expected.detach().float().cpu()
    if actual.shape != expected.shape:
        raise AssertionError(f"{message}: shape {tuple(actual.shape)} != {tuple(expected.shape)}")
    if atol == rtol == 0:
        same = torch.equal(actual, expected)
    else:
        same = torch.allclose(actual, expected, atol=atol, rtol=rtol)
    if not same:
        difference = (actual - expected).abs().max().item()
        raise AssertionError(
            f"{message}: max |difference| {difference:.3g}" + (f"; {detail}" if detail else "")
        )
