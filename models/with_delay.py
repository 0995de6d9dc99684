"""ModuleWithDelay and NestedWrappedModuleWithDelay: a zoo model with real delays added.

`delay_after_loss_ms` delays the device right after the loss is computed (the CPU runs ahead on
CUDA; on CPU the thread sleeps). `delay_before_reduction_ms` delays the device just before each
gradient reduction the FSDP implementation issues, through the wrap's `delay_before_reduction`
hook (adapters provide it; see `DelayHooks`). Torch's zoo patched
`torch.distributed._reduce_scatter_base` for this, which only worked for the one implementation
that called that private name.

    model = NestedWrappedModuleWithDelay(group, wrap=adapter.wrapper(), delay_after_loss_ms=5)
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext
from typing import Any

import torch
from torch import nn

from .delay import sleep_ms
from .model_base import DelayHooks, DeviceInit, Wrap
from .nested import NestedWrappedModule


class ModuleWithDelay(nn.Module):
    """Wraps a zoo model (`module`) and adds delays around its loss and gradient reductions.

    Args:
        module: a zoo model (has get_input / get_loss / run_backward).
        delay_after_loss_ms: delay after computing the loss.
        delay_before_reduction_ms: delay before each gradient reduction (needs `wrap`'s hook;
            with `wrap=None` there is no FSDP reduction to delay and nothing happens).
        wrap: the wrap the inner model was built with (its `delay_before_reduction` is used).
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
        if delay_before_reduction_ms > 0 and wrap is not None and not isinstance(wrap, DelayHooks):
            raise TypeError(
                f"ModuleWithDelay(delay_before_reduction_ms={delay_before_reduction_ms}) needs a "
                f"wrap with a `delay_before_reduction(delay)` hook; got {wrap!r}. Pass "
                "`adapter.wrapper(...)`, or delay_before_reduction_ms=0."
            )
        self.module = module
        self.delay_after_loss_ms = delay_after_loss_ms
        self.delay_before_reduction_ms = delay_before_reduction_ms
        self._wrap = wrap

    @property
    def ROOT_WRAP_CONFIG(self) -> dict[str, Any]:
        """The inner model's root wrap config."""
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
        delayed_reduction = nullcontext()
        if self.delay_before_reduction_ms > 0 and self._wrap is not None:
            ms, device = self.delay_before_reduction_ms, loss.device
            delayed_reduction = self._wrap.delay_before_reduction(lambda: sleep_ms(ms, device))
        with delayed_reduction:
            self.module.run_backward(loss, backward)


class NestedWrappedModuleWithDelay(ModuleWithDelay):
    """A NestedWrappedModule inside a ModuleWithDelay.

    Args:
        group, wrap, device_init, device: as for NestedWrappedModule.
        delay_after_loss_ms, delay_before_reduction_ms: as for ModuleWithDelay.
    """

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
