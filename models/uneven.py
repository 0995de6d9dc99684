"""A model whose parameters shard unevenly over 3 ranks, leaving some ranks empty shards.

    Linear(4, 7) -> Tanh -> [Linear(7, 2)] -> [Gain(2)] -> [Gain(1)]     (brackets = wrapped)

At world size 3: Linear(4, 7)'s 35 elements and Linear(7, 2)'s 16 do not divide by 3 (its 2
rows leave rank 2 without a row); Gain(2) has fewer elements than ranks (rank 2 holds only
padding); Gain(1) lives on rank 0 only. Loss: the sum of squared outputs.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .model_base import (
    DeviceInit,
    Wrap,
    ZooModel,
    maybe_wrap,
    move_before_wrap,
    rand_input,
    seeded_init_,
)


class Gain(nn.Module):
    """Multiplies its input elementwise by a learnt vector of `size` elements."""

    def __init__(self, size: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.weight


class UnevenModule(ZooModel):
    """See the module docstring (`wrap`: wraps the bracketed submodules; None = unwrapped)."""

    def __init__(
        self,
        group: Any,
        wrap: Wrap | None = None,
        *,
        device_init: DeviceInit = DeviceInit.AFTER,
        device: torch.device | None = None,
    ) -> None:
        super().__init__(group)
        layers = [nn.Linear(4, 7), nn.Linear(7, 2), Gain(2), Gain(1)]
        for index, layer in enumerate(layers):
            seeded_init_(layer, seed=index)
            move_before_wrap(layer, device_init, device)
        self.trunk = layers[0]
        self.odd, self.pair, self.one = (maybe_wrap(wrap, layer) for layer in layers[1:])

    def get_input(self, device: torch.device) -> tuple[torch.Tensor]:
        return rand_input(1 + self.rank, device, 3, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.one(self.pair(self.odd(torch.tanh(self.trunk(x)))))

    def get_loss(self, input: tuple[torch.Tensor], output: torch.Tensor) -> torch.Tensor:
        return output.pow(2).sum()
