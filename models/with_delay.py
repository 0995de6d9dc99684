"""ModuleWithDelay and NestedWrappedModuleWithDelay: a zoo model with real delays added.

`delay_after_loss_ms` delays the device right after the loss is computed;
`delay_before_reduction_ms` delays it just before each gradient reduction the implementation
issues, through the wrap's `delay_before_reduction` hook (`DelayHooks`).

    model = NestedWrappedModuleWithDelay(group, wrap=adapter.wrapper(), delay_after_loss_ms=5)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from .delay import sleep_ms
from .model_base import DeviceInit, Wrap, delayed, require_delay_hooks
from .nested import NestedWrappedModule


class ModuleWithDelay(nn.Module):
    """Wraps a zoo model (`module`) and adds delays around its loss and gradient reductions.

    Args:
        module: a zoo model (has get_input / get_loss / run_backward).
        delay_after_loss_ms: delay after computing the loss.
        delay_before_reduction_ms: delay before each gradient reduction (needs `wrap`'s hook;
            with `wrap=None` nothing is delayed).
        wrap: the wrap the inner model was built with.
    """

    def __init__(
        self,
        module: nn.Module,
        *,
        delay_after_loss_ms: float = 0,
        delay_before_reduction_ms: float = 0,
        wrap: Wrap | None = None,
    ) -> None:
        super().__init__()
        reduction_ms = delay_before_reduction_ms
        require_delay_hooks("ModuleWithDelay", "delay_before_reduction_ms", reduction_ms, wrap)
        self.module = module
        self.delay_after_loss_ms = delay_after_loss_ms
        self.delay_before_reduction_ms = delay_before_reduction_ms
        self._wrap = wrap

    @property
    def ROOT_WRAP_CONFIG(self) -> dict[str, Any]:
        return dict(getattr(self.module, "ROOT_WRAP_CONFIG", {}))

    def get_input(self, device: torch.device):
        return self.module.get_input(device)

    def forward(self, *args: Any) -> Any:
        return self.module(*args)

    def get_loss(self, input: Any, output: Any) -> torch.Tensor:
        loss = self.module.get_loss(input, output)
        sleep_ms(self.delay_after_loss_ms, loss.device)
        return loss

    def run_backward(
        self, loss: torch.Tensor, backward: Callable[[torch.Tensor], None] | None = None
    ) -> None:
        ms = self.delay_before_reduction_ms
        with delayed(self._wrap, ms, loss.device, "delay_before_reduction"):
            self.module.run_backward(loss, backward)


class NestedWrappedModuleWithDelay(ModuleWithDelay):
    """A NestedWrappedModule (`group`, `wrap`, `device_init`, `device`) inside a
    ModuleWithDelay (`delay_after_loss_ms`, `delay_before_reduction_ms`)."""

    def __init__(
        self,
        group: Any,
        wrap: Wrap | None = None,
        *,
        delay_after_loss_ms: float = 0,
        delay_before_reduction_ms: float = 0,
        device_init: DeviceInit = DeviceInit.AFTER,
        device: torch.device | None = None,
    ) -> None:
        super().__init__(
            NestedWrappedModule(group, wrap, device_init=device_init, device=device),
            delay_after_loss_ms=delay_after_loss_ms,
            delay_before_reduction_ms=delay_before_reduction_ms,
            wrap=wrap,
        )
