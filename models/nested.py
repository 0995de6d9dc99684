"""NestedWrappedModule and friends: four Linears, some wrapped, one instance nested in another.

Linear(8, 4) -> [[Linear(4, 16)] -> Linear(16, 16)] -> [Linear(16, 4)] -> Linear(4, 8)
(brackets = wrapped; the outer bracket is an instance containing an instance)
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import nn

from fsdp_conformance import constants

from .model_base import (
    DeviceInit,
    Wrap,
    ZooModel,
    maybe_wrap,
    move_before_wrap,
    rand_input,
    seeded_init_,
)

ALWAYS_WRAP = constants.ALWAYS_WRAP


class NestedWrappedModule(ZooModel):
    """The NestedWrappedModule of torch's FSDP test models, seeded without the global RNG;
    `wrap_everything` wraps each of the four Linears instead (four instances, none nested)."""

    def __init__(
        self,
        group: Any,
        wrap: Wrap | None = None,
        *,
        wrap_everything: bool = False,
        device_init: DeviceInit = DeviceInit.AFTER,
        device: torch.device | None = None,
    ) -> None:
        super().__init__(group)
        sizes = ((8, 4), (4, 16), (16, 16), (16, 4), (4, 8))
        layers = [nn.Linear(*size) for size in sizes]
        for index, layer in enumerate(layers):
            seeded_init_(layer, seed=index)  # the same init on every rank, whatever is wrapped
            move_before_wrap(layer, device_init, device)
        lin_8_4, lin_4_16, lin_16_16, lin_16_4, lin_4_8 = layers
        if wrap_everything:
            wrapped = [lin_8_4, lin_4_16, lin_16_4, lin_4_8]
            self.module = nn.Sequential(*(maybe_wrap(wrap, layer) for layer in wrapped))
        else:
            self.module = nn.Sequential(
                lin_8_4,
                maybe_wrap(wrap, nn.Sequential(maybe_wrap(wrap, lin_4_16), lin_16_16)),
                maybe_wrap(wrap, lin_16_4),
                lin_4_8,
            )

    def get_input(self, device: torch.device) -> tuple[torch.Tensor]:
        return rand_input(1 + self.rank, device, 4, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.module(x)

    def get_loss(self, input: tuple[torch.Tensor], output: torch.Tensor) -> torch.Tensor:
        return output.sum()


class AlwaysWrapNestedWrappedModule(NestedWrappedModule):
    """NestedWrappedModule's layers, unwrapped; the caller's root wrap takes
    ``**ROOT_WRAP_CONFIG`` (``auto_wrap_policy="always"``: every submodule an instance), or is
    skipped with ``wrap=None`` (the DDP reference)."""

    ROOT_WRAP_CONFIG: ClassVar[dict[str, Any]] = {"auto_wrap_policy": ALWAYS_WRAP}

    def __init__(
        self,
        group: Any,
        wrap: Wrap | None = None,
        *,
        device_init: DeviceInit = DeviceInit.AFTER,
        device: torch.device | None = None,
    ) -> None:
        super().__init__(group, None, device_init=device_init, device=device)
