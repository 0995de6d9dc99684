"""A model whose parameters shard unevenly over 3 ranks, leaving some ranks empty shards.

    Linear(4, 7) -> Tanh -> [Linear(7, 2)] -> [Gain(2)] -> [Gain(1)]
    (brackets = wrapped)

At world size 3: the root holds Linear(4, 7)'s 35 elements (not divisible by 3; FSDP2 shards
its 7 rows 3 / 3 / 1); the wrapped Linear(7, 2) 16 elements (not divisible; its 2 rows leave
rank 2 without a row); Gain(2) two elements, one fewer than the world size (a flat shard of one
element per rank: rank 2 holds only padding); Gain(1) a 1-element parameter (only rank 0 holds
it). Loss: the sum of squared outputs, so every gradient depends on every parameter.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar

import torch
from torch import nn

from .model_base import (
    DeviceInit,
    Wrap,
    generator,
    maybe_wrap,
    move_before_wrap,
    run_loss_backward,
    seeded_init_,
)


class Gain(nn.Module):
    """Multiplies its input elementwise by a learnt vector of `size` elements."""

    def __init__(self, size: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.weight


class UnevenModule(nn.Module):
    """See the module docstring.

    Args:
        group: the process group (its rank seeds the inputs).
        wrap: wraps the bracketed submodules; None = unwrapped reference.
    """

    ROOT_WRAP_CONFIG: ClassVar[dict[str, Any]] = {}

    def __init__(
        self,
        group: Any,
        wrap: Wrap | None = None,
        *,
        device_init: DeviceInit = DeviceInit.AFTER,
        device: torch.device | None = None,
    ) -> None:
        super().__init__()
        self.rank = group.rank()
        layers = [nn.Linear(4, 7), nn.Linear(7, 2), Gain(2), Gain(1)]
        for index, layer in enumerate(layers):
            seeded_init_(layer, seed=index)
            move_before_wrap(layer, device_init, device)
        self.trunk = layers[0]
        self.odd, self.pair, self.one = (maybe_wrap(wrap, layer) for layer in layers[1:])

    def get_input(self, device: torch.device) -> tuple[torch.Tensor]:
        return (torch.rand(3, 4, generator=generator(1 + self.rank)).to(device),)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.one(self.pair(self.odd(torch.tanh(self.trunk(x)))))

    def get_loss(self, input: tuple[torch.Tensor], output: torch.Tensor) -> torch.Tensor:
        return output.pow(2).sum()

    def run_backward(
        self, loss: torch.Tensor, backward: Callable[[torch.Tensor], None] | None = None
    ) -> None:
        run_loss_backward(loss, backward)
