"""What every zoo model shares: the `wrap` protocol, device init modes, per-rank seeding.

[Note: seeding without the global RNG]
Ranks may be threads of one process (the harness's `thread` mode), where ``torch.manual_seed``
races between ranks. So the zoo never draws from the global generator: parameters are
(re)initialised and inputs drawn from a local ``torch.Generator`` seeded with a fixed value
(shared parameters: identical on every rank) or ``seed + rank`` (inputs, MoE experts).
Dropout is 0 everywhere for the same reason (a forward that draws random numbers cannot be
compared with a reference run).
"""

from __future__ import annotations

import enum
import math
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn


class Wrap(Protocol):
    """Turns a submodule into an FSDP instance: ``wrap(module, **overrides) -> nn.Module``.

    ``overrides`` are config keys of the adapter vocabulary (e.g. ``process_group=...``).
    ``None`` instead of a ``Wrap`` means "do not wrap" (the DDP reference run).
    """

    def __call__(self, module: nn.Module, **overrides: Any) -> nn.Module: ...


@runtime_checkable
class DelayHooks(Protocol):
    """Optional extras of a ``Wrap`` (adapters provide them) that the delay models use.

    ``delay_before_reduction(delay)``: while active, ``delay()`` runs just before each gradient
    reduction the implementation issues.
    ``delay_before_free(instance, delay)``: while active, ``delay()`` runs just before
    ``instance`` frees its unsharded parameters.
    """

    def delay_before_reduction(self, delay: Callable[[], None]) -> AbstractContextManager[None]: ...

    def delay_before_free(
        self, instance: nn.Module, delay: Callable[[], None]
    ) -> AbstractContextManager[None]: ...


class DeviceInit(enum.Enum):
    """When the model moves to the compute device, relative to wrapping (seed's FSDPInitMode)."""

    # Move every submodule to the device before it is wrapped
    BEFORE = "before"
    # Build on CPU; the caller moves the wrapped root with `.to(device)` (see `move_after_wrap`)
    AFTER = "after"
    # Never move: the implementation places parameters itself (e.g. from `device_id`)
    NEVER = "never"
    # The seed's names (``FSDPInitMode``, which is this enum): aliases of the three above
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


def maybe_wrap(wrap: Wrap | None, module: nn.Module, **overrides: Any) -> nn.Module:
    """``wrap(module, **overrides)``, or ``module`` itself when ``wrap`` is None."""
    return module if wrap is None else wrap(module, **overrides)


def generator(seed: int) -> torch.Generator:
    """A CPU generator seeded with ``seed`` (see [Note: seeding without the global RNG])."""
    return torch.Generator().manual_seed(seed)


@torch.no_grad()
def seeded_init_(module: nn.Module, seed: int) -> nn.Module:
    """Re-initialise every parameter of ``module`` from a local generator; returns ``module``.

    Normalisation layers keep their deterministic defaults (weight 1, bias 0). Every other
    parameter is drawn uniformly from ±1/sqrt(fan_in) (fan_in = last dim for matrices, 16
    for vectors), close to torch's defaults, in ``named_parameters()`` order.
    Shared (tied) parameters appear once in that order, so they stay tied.
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
    """`backward(loss)` when the caller gives its own backward (an adapter whose engine owns
    backward: ``Adapter.backward``), else ``loss.backward()``."""
    if backward is None:
        loss.backward()
    else:
        backward(loss)
