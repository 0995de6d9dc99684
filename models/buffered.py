"""A model with persistent and non-persistent buffers and odd sizes, for the full-state-dict and
meta-device-init checks.

    BufferedModule: trunk Linear(8, 15) -> [block 0] -> [block 1] -> [head Linear(15, 8)]
    (brackets = wrapped; block = tanh(Linear(15, 15)(x)) * scale * gain + shift, where `scale`
    is a non-persistent buffer, `shift` and `gain` persistent ones)

Odd sizes make every flat parameter or dim-0 shard uneven at world size 2. Every module holding
tensors has ``reset_parameters()`` (what meta-device materialisation calls). A ``SeededLinear``
draws from its own generator: the first initialisation gives the CPU build's values, every
further call others, so a module initialised twice shows. ``meta=True`` creates every tensor on
the meta device.
"""

from __future__ import annotations

import math
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
    rand_input,
)

FEATURES = 15  # odd: uneven shards at world size 2


def _fill(param: torch.Tensor, values: torch.Tensor) -> None:
    """Write full-shape `values` into `param`, or into this rank's part of a sharded DTensor."""
    if hasattr(param, "device_mesh"):
        from torch.distributed.tensor import distribute_tensor

        values = distribute_tensor(
            values.to(param.device), param.device_mesh, param.placements, src_data_rank=None
        )
    param.copy_(values)


class SeededLinear(nn.Linear):
    """``nn.Linear`` whose every ``reset_parameters`` draws its own generator's next values
    (uniform in +-1/sqrt(in_features)); nothing is drawn while on the meta device."""

    def __init__(self, in_features: int, out_features: int, seed: int, device: Any = None):
        super().__init__(in_features, out_features, device=device)
        self._generator = generator(seed)
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        gen = self.__dict__.get("_generator")
        if gen is None or self.weight.is_meta:  # nn.Linear.__init__'s call, or still on meta
            return
        bound = 1.0 / math.sqrt(self.in_features)
        for param in (self.weight, self.bias):
            _fill(param, torch.rand(param.shape, generator=gen, device="cpu") * 2 * bound - bound)


class Affine(nn.Module):
    """``x * scale * gain + shift`` from buffers: ``scale`` non-persistent (only initialisation
    sets it), ``shift`` and ``gain`` persistent and of one shape (a mix-up shows)."""

    def __init__(self, features: int, device: Any = None) -> None:
        super().__init__()
        self.register_buffer("scale", torch.empty(features, device=device), persistent=False)
        self.register_buffer("shift", torch.empty(features, device=device))
        self.register_buffer("gain", torch.empty(features, device=device))
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        if self.scale.is_meta:
            return
        n = self.scale.numel()
        self.scale.copy_(1.0 + torch.arange(n, device="cpu") / n)
        self.shift.copy_(torch.linspace(-0.5, 0.5, n, device="cpu"))
        self.gain.copy_(torch.linspace(1.3, 0.7, n, device="cpu"))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.scale * self.gain + self.shift


class BufferedBlock(nn.Module):
    """``Affine(tanh(SeededLinear(x)))`` (what the checks' auto-wrap policy picks)."""

    def __init__(self, seed: int, device: Any = None) -> None:
        super().__init__()
        self.lin = SeededLinear(FEATURES, FEATURES, seed, device)
        self.affine = Affine(FEATURES, device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.affine(torch.tanh(self.lin(x)))


class BufferedModule(ZooModel):
    """See the module docstring (`wrap`: wraps the two blocks and the head, inner first;
    `meta`: create every parameter and buffer on the meta device)."""

    def __init__(
        self,
        group: Any,
        wrap: Wrap | None = None,
        *,
        meta: bool = False,
        device_init: DeviceInit = DeviceInit.AFTER,
        device: torch.device | None = None,
    ) -> None:
        super().__init__(group)
        on = torch.device("meta") if meta else None
        device = None if meta else device
        self.trunk = SeededLinear(8, FEATURES, 1, on)
        blocks = [move_before_wrap(BufferedBlock(seed, on), device_init, device) for seed in (2, 3)]
        self.blocks = nn.Sequential(*(maybe_wrap(wrap, block) for block in blocks))
        head = move_before_wrap(SeededLinear(FEATURES, 8, 4, on), device_init, device)
        self.head = maybe_wrap(wrap, head)
        move_before_wrap(self.trunk, device_init, device)

    def get_input(self, device: torch.device) -> tuple[torch.Tensor]:
        return rand_input(13 + self.rank, device, 4, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(torch.relu(self.trunk(x))))  # (B, 8)

    def get_loss(self, input: tuple[torch.Tensor], output: torch.Tensor) -> torch.Tensor:
        return output.square().sum()
