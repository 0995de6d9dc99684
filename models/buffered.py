"""A model with persistent and non-persistent buffers and odd sizes, for the full-state-dict and
meta-device-init checks.

    BufferedModule: trunk Linear(8, 15) -> [block 0] -> [block 1] -> [head Linear(15, 8)]
    (brackets = wrapped; block = tanh(Linear(15, 15)(x)) * scale * gain + shift, where `scale`
    is a non-persistent buffer, `shift` and `gain` persistent ones)

Sizes are odd, so every flat parameter or dim-0 shard is uneven at world size 2. Every module
holding parameters or buffers has ``reset_parameters()``, the hook meta-device materialisation
calls (torch FSDP1's default, FSDP2's ``to_empty`` + ``reset_parameters``). A ``SeededLinear``
draws its values from its own generator, seeded at construction: its first initialisation gives
the values of a model built on the CPU, and every further call gives others -- so a module
initialised twice (a nested instance re-initialised by its root's materialisation) shows in
its values. With ``meta=True`` every tensor is created on the meta device (nothing drawn).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, ClassVar

import torch
from torch import nn

from .model_base import DeviceInit, Wrap, generator, maybe_wrap, move_before_wrap, run_loss_backward

FEATURES = 15  # odd: uneven shards at world size 2


def _fill(param: torch.Tensor, values: torch.Tensor) -> None:
    """Write the full-shape `values` into `param`: a plain tensor, or this rank's part of a
    sharded DTensor parameter (torch FSDP2, after ``to_empty``)."""
    if hasattr(param, "device_mesh"):
        from torch.distributed.tensor import distribute_tensor

        values = distribute_tensor(
            values.to(param.device), param.device_mesh, param.placements, src_data_rank=None
        )
    param.copy_(values)


class SeededLinear(nn.Linear):
    """``nn.Linear`` initialised from its own generator; each ``reset_parameters`` call draws
    the generator's next values (uniform in +-1/sqrt(in_features)). Nothing is drawn while the
    parameters are on the meta device."""

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
    """``x * scale * gain + shift`` from buffers: ``scale`` non-persistent (not in the state
    dict: only initialisation gives it its values), ``shift`` and ``gain`` persistent (two of one
    shape in one instance: a state dict that mixes up an instance's buffers shows)."""

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
    """``Affine(tanh(SeededLinear(x)))`` (what the auto-wrap policy of the checks picks)."""

    def __init__(self, seed: int, device: Any = None) -> None:
        super().__init__()
        self.lin = SeededLinear(FEATURES, FEATURES, seed, device)
        self.affine = Affine(FEATURES, device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.affine(torch.tanh(self.lin(x)))


class BufferedModule(nn.Module):
    """The checks' model (see the module docstring).

    Args:
        group: the process group (its rank seeds the inputs).
        wrap: wraps the two blocks and the head (inner first); None = unwrapped.
        meta: create every parameter and buffer on the meta device.
    """

    ROOT_WRAP_CONFIG: ClassVar[dict[str, Any]] = {}

    def __init__(
        self,
        group: Any,
        wrap: Wrap | None = None,
        *,
        meta: bool = False,
        device_init: DeviceInit = DeviceInit.AFTER,
        device: torch.device | None = None,
    ) -> None:
        super().__init__()
        self.rank = group.rank()
        on = torch.device("meta") if meta else None
        self.trunk = SeededLinear(8, FEATURES, 1, on)
        blocks = []
        for seed in (2, 3):
            block = move_before_wrap(BufferedBlock(seed, on), device_init, None if meta else device)
            blocks.append(maybe_wrap(wrap, block))
        self.blocks = nn.Sequential(*blocks)
        head = move_before_wrap(
            SeededLinear(FEATURES, 8, 4, on), device_init, None if meta else device
        )
        self.head = maybe_wrap(wrap, head)
        move_before_wrap(self.trunk, device_init, None if meta else device)

    def get_input(self, device: torch.device) -> tuple[torch.Tensor]:
        return (torch.rand(4, 8, generator=generator(13 + self.rank)).to(device),)  # (B=4, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(torch.relu(self.trunk(x))))  # (B, 8)

    def get_loss(self, input: tuple[torch.Tensor], output: torch.Tensor) -> torch.Tensor:
        return output.square().sum()

    def run_backward(
        self, loss: torch.Tensor, backward: Callable[[torch.Tensor], None] | None = None
    ) -> None:
        run_loss_backward(loss, backward)
