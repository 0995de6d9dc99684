"""TiedInstances: one parameter used by two FSDP instances (a tied embedding and output head
wrapped apart).

    [embed: Embedding(12, 8)] -> Linear(8, 8) -> Tanh -> [head: Linear(8, 12)]
    (brackets = wrapped, each on its own; head.weight IS embed.weight)

An implementation either refuses the second wrap, naming the shared parameter, or trains the
one parameter as DDP does (both uses' gradients summed into it).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .model_base import (
    DeviceInit,
    Wrap,
    ZooModel,
    generator,
    maybe_wrap,
    move_before_wrap,
    seeded_init_,
)


class TiedInstances(ZooModel):
    """See the module docstring (`wrap`: wraps the embedding and the head apart)."""

    VOCAB = 12

    def __init__(
        self,
        group: Any,
        wrap: Wrap | None = None,
        *,
        device_init: DeviceInit = DeviceInit.AFTER,
        device: torch.device | None = None,
    ) -> None:
        super().__init__(group)
        self.embed = nn.Embedding(self.VOCAB, 8)
        self.body = nn.Linear(8, 8)
        self.head = nn.Linear(8, self.VOCAB)
        self.head.weight = self.embed.weight
        seeded_init_(self, seed=3)
        move_before_wrap(self, device_init, device)
        self.embed = maybe_wrap(wrap, self.embed)
        self.head = maybe_wrap(wrap, self.head)

    def get_input(self, device: torch.device) -> tuple[torch.Tensor]:
        ids = torch.randint(0, self.VOCAB, (4, 3), generator=generator(5 + self.rank))
        return (ids.to(device),)  # (B=4, T=3)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.body(self.embed(ids))))  # (B, T, VOCAB)

    def get_loss(self, input: tuple[torch.Tensor], output: torch.Tensor) -> torch.Tensor:
        (ids,) = input
        return nn.functional.cross_entropy(output.flatten(0, 1), ids.flatten(), reduction="sum")
