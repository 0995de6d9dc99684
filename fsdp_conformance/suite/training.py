"""torch's `_test_identical_outputs` (common_fsdp.py), adapter-driven: train FSDP and DDP, compare.

`reference_run` trains the unwrapped zoo model under DistributedDataParallel (or DummyDDP) and
caches the result per rank process (a rank set is reused across tests in the harness's
`process` mode, so the reference is computed once per model, world size and step count).
`fsdp_run` builds, wraps and trains the same model through an adapter. `assert_same_training`
compares, step by step, the losses and -- where the adapter reads its local gradient shards
(`Adapter.grad_shards`) -- each rank's gradient shards with the matching slice of DDP's full
gradients after every backward, then the full parameters, naming the config, the step and the
first parameter that differs. Both runs call ``optimizer.zero_grad(set_to_none=...)`` with True
and False alternating (True in step 0), so accumulating into a zeroed gradient is exercised.
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
from fsdp_conformance.adapters import loop as adapter_loop
from fsdp_conformance.models import DeviceInit, DummyDDP, move_after_wrap

from . import zoo

# Training: SGD with momentum
STEPS = 3
LR = 0.01
MOMENTUM = 0.9


@dataclasses.dataclass
class TrainingResult:
    """What one training run produced."""

    # (steps,) fp32 losses
    losses: torch.Tensor
    # Full parameters after the last step, by the unwrapped model's names (tied ones under
    # each name)
    params: dict[str, torch.Tensor]
    # Per step, the gradients right after backward by the unwrapped model's names: DDP's full
    # gradients, or an FSDP run's `Adapter.grad_shards`; None: the adapter does not read them
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
    """`steps` SGD+momentum steps of `model` (a wrapped `zoo_model`); returns the fp32 losses.

    Args:
        after_backward: called with the step index after backward, before optimizer.step().
        after_step: called with the step index after optimizer.step().
        adapter: the adapter that wrapped `model`: the optimizer and backward are its own
            (`Adapter.optimizer`, `Adapter.backward`); None (the DDP reference) uses torch's.
        around_forward: step index -> a context manager the forward of that step runs in
            (after zero_grad; the loss is computed outside it).
        phase: each step's forward and backward run inside ``phase(step)`` (e.g. a comm
            trace's phase).
    """
    if adapter is None:
        optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    else:
        optimizer = adapter_loop.optimizer(adapter, model, "sgd", lr=LR, momentum=MOMENTUM)
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
    """Backward of `loss` through `adapter` (`Adapter.backward`).

    Under ``grad_reduction == "sum"`` each instance's gradients are divided by its own group
    size (`Adapter.group_size`), so summed gradients equal DDP's averaged ones also for an
    instance on another group (the MoE expert on one rank, a model wrapped on a subgroup): the
    loss is divided by the root's group size, and a gradient hook on the parameters of each
    instance on a group of another size multiplies what reaches them by root size / own size
    (linear, so it holds whether the implementation reduces before or after the hook).
    """
    if adapter_features.declared(adapter).grad_reduction != "sum":
        adapter_loop.backward(adapter, model, loss)
        return
    instances = adapter.instances(model)
    root_size = adapter_loop.group_size(adapter, instances[0] if instances else model)
    handles = []
    for instance in instances[1:]:
        size = adapter_loop.group_size(adapter, instance)
        if size != root_size:
            for param in own_parameters(instances, instance):
                if param.requires_grad:
                    handles.append(param.register_hook(_scaled(root_size / size)))
    try:
        adapter_loop.backward(adapter, model, loss / root_size)
    finally:
        for handle in handles:
            handle.remove()


def _scaled(factor: float) -> Callable[[torch.Tensor], torch.Tensor]:
    return lambda grad: grad * factor


def own_parameters(instances: list[nn.Module], instance: nn.Module) -> list[torch.Tensor]:
    """The parameters `instance` registers itself: in its module tree, outside the trees of the
    other `instances` nested in it (flat parameters, DTensor shards, parametrization
    originals)."""
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
            grads.append(
                {
                    name: param.grad.detach().clone()
                    for name, param in model.named_parameters(remove_duplicate=False)
                    if param.grad is not None
                }
            )

        losses = train(wrapped, model, dist.device, steps, after_backward=record_grads)
        params = {
            name: param.detach().clone()
            for name, param in model.named_parameters(remove_duplicate=False)
        }
        _reference_cache[key] = TrainingResult(losses, params, grads)
    return _reference_cache[key]


def wrap_model(
    adapter: Adapter,
    model_name: str,
    dist: Any,
    config: dict[str, Any],
    device_init: str = "after",
) -> tuple[nn.Module, nn.Module]:
    """Build the zoo model with `adapter`'s wrap and `config`; returns (root, zoo model).

    Skips (through `adapter.require`) when the adapter lacks a feature the config or the model
    needs, naming the adapter, the feature and the reason.
    """
    spec = zoo.MODELS[model_name]
    adapter_features.skip_unless(adapter, *spec.features)
    adapter_features.skip_unless(adapter, *adapter_features.wrap_features(adapter, **config))
    wrap = adapter.wrapper(**config)
    zoo_model = zoo.build(model_name, dist.group, wrap, dist.device, device_init)
    root_config = {**config, **zoo_model.ROOT_WRAP_CONFIG}
    adapter_features.skip_unless(adapter, *adapter_features.wrap_features(adapter, **root_config))
    if DeviceInit(device_init) is DeviceInit.NEVER and dist.device.type != "cpu":
        root_config.setdefault("device_id", dist.device)  # the implementation moves it
    root = adapter.wrap(zoo_model, root=True, **root_config)
    root = move_after_wrap(root, DeviceInit(device_init), dist.device)
    return root, zoo_model


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
    """Train a wrapped root `steps` steps (`phase` as `train` takes it); with the gradient
    shards after every backward where the adapter reads them (`Adapter.grad_shards`)."""
    grads: list[Any] = []

    def record_grads(step: int) -> None:
        shards = adapter_loop.grad_shards(adapter, root)
        grads.append(
            None
            if shards is None
            else {name: (start, values.clone()) for name, (start, values) in shards.items()}
        )

    losses = train(root, zoo_model, dist.device, steps, record_grads, adapter=adapter, phase=phase)
    readable = all(shards is not None for shards in grads)
    return TrainingResult(
        losses, adapter_loop.full_params(adapter, root), grads if readable else None
    )


def assert_same_training(
    label: str,
    actual: TrainingResult,
    expected: TrainingResult,
    atol: float = 0.0,
    rtol: float = 0.0,
    loss_atol: float | None = None,
    loss_rtol: float | None = None,
) -> None:
    """Assert equal losses and full parameters; bit-exact when the tolerances are 0.

    Args:
        label: names the run in the message (adapter, model, world size, config).
        atol, rtol: tolerance of the parameters (and of the losses unless given below).
        loss_atol, loss_rtol: tolerance of the losses.
    """
    loss_atol = atol if loss_atol is None else loss_atol
    loss_rtol = rtol if loss_rtol is None else loss_rtol
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
        _assert_close(
            f"{label}: losses differ from DDP's at step {step} "
            f"({_tolerance(loss_atol, loss_rtol)})",
            actual.losses[step],
            expected.losses[step],
            loss_atol,
            loss_rtol,
            detail=detail,
        )
        if actual.grads is not None and expected.grads is not None:
            assert_grad_shards(label, step, actual.grads[step], expected.grads[step], atol, rtol)
    for name, reference in expected.params.items():
        _assert_close(
            f"{label}: parameter {name!r} differs from DDP's after {len(expected.losses)} "
            f"steps ({_tolerance(atol, rtol)})",
            actual.params[name],
            reference,
            atol,
            rtol,
        )


def assert_grad_shards(
    label: str,
    step: int,
    shards: dict[str, tuple[int, torch.Tensor]],
    full: dict[str, torch.Tensor],
    atol: float = 0.0,
    rtol: float = 0.0,
) -> None:
    """Each of this rank's gradient pieces (`Adapter.grad_shards`) equals the matching slice of
    DDP's full gradient after the same backward."""
    for name, (start, values) in shards.items():
        if name not in full:
            raise AssertionError(
                f"{label}: after step {step}'s backward the FSDP run holds a gradient of "
                f"{name!r}, DDP has none (DDP's: {sorted(full)})"
            )
        expected = full[name].reshape(-1)[start : start + values.numel()]
        _assert_close(
            f"{label}: after step {step}'s backward, this rank's gradient shard of {name!r} "
            f"(elements {start}..{start + values.numel()} of the flattened parameter) differs "
            f"from DDP's gradient there ({_tolerance(atol, rtol)})",
            values,
            expected,
            atol,
            rtol,
        )


def _tolerance(atol: float, rtol: float) -> str:
    return "bit-exact" if atol == rtol == 0 else f"atol={atol:g}, rtol={rtol:g}"


def _assert_close(
    message: str,
    actual: torch.Tensor,
    expected: torch.Tensor,
    atol: float,
    rtol: float,
    detail: str = "",
) -> None:
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
