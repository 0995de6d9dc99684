"""What every zoo model shares: the `wrap` protocol, device init modes, per-rank seeding.

[Note: seeding without the global RNG]
Ranks may be threads of one process, where ``torch.manual_seed`` races between ranks. So the zoo
draws only from local generators seeded with a fixed value (shared parameters) or ``seed +
rank`` (inputs, MoE experts), and dropout is 0 everywhere.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import Any, ClassVar, Protocol, runtime_checkable

import torch
from torch import nn

from .delay import sleep_ms


class Wrap(Protocol):
    """Turns a submodule into an FSDP instance: ``wrap(module, **overrides) -> nn.Module``.

    ``overrides`` are adapter config keys (e.g. ``process_group=...``); ``None`` instead of a
    ``Wrap`` means "do not wrap" (the DDP reference).
    """

    def __call__(self, module: nn.Module, **overrides: Any) -> nn.Module: ...


@runtime_checkable
class DelayHooks(Protocol):
    """Optional extras of a ``Wrap`` that the delay models use: while active, ``delay()`` runs
    just before each gradient reduction / just before ``instance`` frees its unsharded
    parameters."""

    def delay_before_reduction(self, delay: Callable[[], None]) -> AbstractContextManager[None]: ...

    def delay_before_free(
        self, instance: nn.Module, delay: Callable[[], None]
    ) -> AbstractContextManager[None]: ...


class DeviceInit(enum.Enum):
    """When the model moves to the compute device, relative to wrapping (seed's FSDPInitMode):
    BEFORE each submodule is wrapped, AFTER (the caller moves the wrapped root, see
    `move_after_wrap`), or NEVER (the implementation places parameters itself)."""

    BEFORE = "before"
    AFTER = "after"
    NEVER = "never"
    # the seed's names: aliases of the three above
    DEVICE_BEFORE = "before"  # noqa: PIE796
    DEVICE_AFTER = "after"  # noqa: PIE796
    DEVICE_NEVER = "never"  # noqa: PIE796
    CUDA_BEFORE = "before"  # noqa: PIE796
    CUDA_AFTER = "after"  # noqa: PIE796
    CUDA_NEVER = "never"  # noqa: PIE796


def move_before_wrap(module: nn.Module, device_init: DeviceInit, device: torch.device | None):
    """Move ``module`` to ``device`` if ``device_init`` is BEFORE; returns ``module``."""
    if device_init is DeviceInit.BEFORE and device is not None:
        module.to(device)
    return module


def move_after_wrap(model: nn.Module, device_init: DeviceInit, device: torch.device | None):
    """The caller's half of AFTER: move the wrapped root to ``device``; returns the model."""
    if device_init is DeviceInit.AFTER and device is not None:
        model = model.to(device)
    return model


# each delay argument's DelayHooks method
_DELAY_HOOKS = {
    "delay_before_reduction_ms": "delay_before_reduction(delay)",
    "delay_before_free_ms": "delay_before_free(instance, delay)",
}


def require_delay_hooks(owner: str, arg: str, ms: float, wrap: Wrap | None) -> None:
    """TypeError unless a positive delay ``arg`` of ``owner`` comes with a ``DelayHooks`` wrap."""
    if ms > 0 and wrap is not None and not isinstance(wrap, DelayHooks):
        raise TypeError(
            f"{owner}({arg}={ms}) needs a wrap with a `{_DELAY_HOOKS[arg]}` hook; got {wrap!r}. "
            f"Pass `adapter.wrapper(...)`, or {arg}=0."
        )


def delayed(wrap: Any, ms: float, device: torch.device, hook: str, *args: Any):
    """``wrap.<hook>(*args, delay)`` with a delay of ``ms`` on ``device``; a no-op context when
    ``ms`` is 0 or there is no wrap."""
    if ms <= 0 or wrap is None:
        return nullcontext()
    return getattr(wrap, hook)(*args, lambda: sleep_ms(ms, device))


def maybe_wrap(wrap: Wrap | None, module: nn.Module, **overrides: Any) -> nn.Module:
    return module if wrap is None else wrap(module, **overrides)


def generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def rand_input(seed: int, device: torch.device, *shape: int) -> tuple[torch.Tensor]:
    """``(uniform tensor of shape,)`` from ``generator(seed)``, on ``device``."""
    return (torch.rand(*shape, generator=generator(seed)).to(device),)


@torch.no_grad()
def seeded_init_(module: nn.Module, seed: int) -> nn.Module:
    """Re-initialise every parameter of ``module`` from a local generator; returns ``module``.

    Normalisation layers keep weight 1, bias 0; every other parameter is drawn uniformly from
    ±1/sqrt(fan_in) (fan_in = last dim for matrices, 16 for vectors) in ``named_parameters()``
    order, where tied parameters appear once (so they stay tied).
    """
    gen = generator(seed)
    norm_params = {
        id(p)
        for m in module.modules()
        if isinstance(m, (nn.LayerNorm, nn.modules.batchnorm._BatchNorm))
        for p in m.parameters(recurse=False)
    }
    for _, param in module.named_parameters():
        if id(param) in norm_params:
            continue
        fan_in = param.shape[-1] if param.dim() >= 2 else 16
        bound = 1.0 / math.sqrt(fan_in)
        values = torch.rand(param.shape, generator=gen, dtype=torch.float32) * 2 * bound - bound
        param.copy_(values.to(param.dtype))
    return module


def run_loss_backward(
    loss: torch.Tensor, backward: Callable[[torch.Tensor], None] | None = None
) -> None:
    """`backward(loss)` when given (an adapter whose engine owns backward), else
    ``loss.backward()``."""
    if backward is None:
        loss.backward()
    else:
        backward(loss)


class ZooModel(nn.Module):
    """A zoo model's defaults. Every model takes ``group`` (its rank seeds the inputs), ``wrap``
    (None: the unwrapped reference), ``device_init`` and ``device`` (see ``DeviceInit``)."""

    ROOT_WRAP_CONFIG: ClassVar[dict[str, Any]] = {}

    def __init__(self, group: Any) -> None:
        super().__init__()
        self.rank = group.rank()
        self.world_size = group.size()

    def run_backward(
        self, loss: torch.Tensor, backward: Callable[[torch.Tensor], None] | None = None
    ) -> None:
        run_loss_backward(loss, backward)
