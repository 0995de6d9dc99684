"""Models for the training-loop checks: per-instance gradient scales, a skippable branch,
frozen parameters, and non-reentrant activation checkpointing inside wrapped blocks.

    LoopModule: Linear(8, 16) -> [block 0] -> [block 1] -> [block 2] -> ([branch]) -> [head]
    (brackets = wrapped; block i = Sequential(Linear(16, 16), Tanh, Scale(gains[i])))
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from .model_base import (
    DeviceInit,
    Wrap,
    ZooModel,
    generator,
    maybe_wrap,
    move_before_wrap,
    rand_input,
)


class CheckpointedModule(nn.Module):
    """Runs `module` under non-reentrant activation checkpointing (recomputed in backward).
    The attribute name is the one the adapters' parameter-name cleaning removes."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self._checkpoint_wrapped_module = module

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return checkpoint(self._checkpoint_wrapped_module, *args, use_reentrant=False, **kwargs)

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name == "_checkpoint_wrapped_module":
                raise
            return getattr(self._checkpoint_wrapped_module, name)


class CheckpointingWrap:
    """A zoo `wrap` that checkpoints each wrapped module's forward and wraps it with `wrap`
    (None: checkpointing only); other attributes (the delay hooks) forward to `wrap`.

    Args:
        outside: False: the FSDP instance runs checkpoint around its module (torch's
            ``checkpoint_wrapper`` before wrapping); True: checkpoint runs around the instance,
            so the recompute re-enters the instance's forward during its backward.
    """

    def __init__(self, wrap: Wrap | None, outside: bool = False) -> None:
        self.wrap = wrap
        self.outside = outside

    def __call__(self, module: nn.Module, **overrides: Any) -> nn.Module:
        if self.outside:
            return CheckpointedModule(maybe_wrap(self.wrap, module, **overrides))
        return maybe_wrap(self.wrap, CheckpointedModule(module), **overrides)

    def __getattr__(self, name: str) -> Any:
        if name in ("wrap", "outside"):
            raise AttributeError(name)
        return getattr(self.wrap, name)


class Scale(nn.Module):
    """Multiplies by a constant (with ``buffer``: held in a 0-dim float buffer ``gain_buffer``)."""

    def __init__(self, gain: float, buffer: bool = False) -> None:
        super().__init__()
        self.gain = gain
        if buffer:
            self.register_buffer("gain_buffer", torch.tensor(float(gain)))
        else:
            self.gain_buffer = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * (self.gain if self.gain_buffer is None else self.gain_buffer)


class LoopModule(ZooModel):
    """The training-loop checks' model (see the module docstring).

    Args:
        gains: one per block, its output scale (instances' gradient magnitudes then differ by
            orders of magnitude, so the clipping norm depends on every shard).
        branch: add a wrapped Linear(16, 16) branch, used while `use_branch` is True (the
            caller sets it, the same on every rank).
        freeze: None, "instance" (block 0 entirely) or "mixed" (block 0's Linear weight only).
        no_shard_block: index of a block wrapped with ``sharding_strategy="NO_SHARD"``.
        buffer: add floating-point buffers (what buffer_dtype casts): the root's ``offset``,
            added to the trunk's output, and each block's ``Scale.gain_buffer``.
        norm: blocks are ``Sequential(linear=Linear(16, 16), norm=LayerNorm(16), act=Tanh,
            scale=Scale)`` (named, for optimizer groups by name).
    """

    def __init__(
        self,
        group: Any,
        wrap: Wrap | None = None,
        *,
        gains: tuple[float, ...] = (1.0, 1.0, 1.0),
        branch: bool = False,
        freeze: str | None = None,
        no_shard_block: int | None = None,
        buffer: bool = False,
        norm: bool = False,
        device_init: DeviceInit = DeviceInit.AFTER,
        device: torch.device | None = None,
    ) -> None:
        super().__init__(group)
        if freeze not in (None, "instance", "mixed"):
            raise ValueError(f"LoopModule freeze={freeze!r}: use None, 'instance' or 'mixed'")
        self.use_branch = branch
        gen = generator(7)
        self.trunk = _init(nn.Linear(8, 16), gen)
        blocks = []
        for index, gain in enumerate(gains):
            if norm:
                block = nn.Sequential(
                    OrderedDict(
                        linear=_init(nn.Linear(16, 16), gen),
                        norm=nn.LayerNorm(16),
                        act=nn.Tanh(),
                        scale=Scale(gain),
                    )
                )
            else:
                block = nn.Sequential(
                    _init(nn.Linear(16, 16), gen), nn.Tanh(), Scale(gain, buffer=buffer)
                )
            if index == 0 and freeze == "instance":
                block.requires_grad_(False)
            elif index == 0 and freeze == "mixed":
                block[0].weight.requires_grad_(False)
            move_before_wrap(block, device_init, device)
            overrides = {"sharding_strategy": "NO_SHARD"} if index == no_shard_block else {}
            blocks.append(maybe_wrap(wrap, block, **overrides))
        self.blocks = nn.Sequential(*blocks)
        branch_module = move_before_wrap(_init(nn.Linear(16, 16), gen), device_init, device)
        self.branch = maybe_wrap(wrap, branch_module) if branch else None
        head = move_before_wrap(_init(nn.Linear(16, 8), gen), device_init, device)
        self.head = maybe_wrap(wrap, head)
        move_before_wrap(self.trunk, device_init, device)
        if buffer:
            at = device if device_init is DeviceInit.BEFORE else None
            self.register_buffer("offset", torch.linspace(-0.5, 0.5, 16, device=at))
        else:
            self.offset = None

    def get_input(self, device: torch.device) -> tuple[torch.Tensor]:
        return rand_input(11 + self.rank, device, 4, 8)

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """The trunk and the blocks, without the head: a method other than forward (B, 16)."""
        x = torch.relu(self.trunk(x))
        if self.offset is not None:
            x = x + self.offset
        return self.blocks(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.encode(x)
        if self.branch is not None and self.use_branch:
            x = x + self.branch(x)
        return self.head(x)

    def get_loss(self, input: tuple[torch.Tensor], output: torch.Tensor) -> torch.Tensor:
        return output.square().sum()


@torch.no_grad()
def _init(linear: nn.Linear, gen: torch.Generator) -> nn.Linear:
    bound = 1.0 / linear.in_features**0.5
    for param in (linear.weight, linear.bias):
        param.copy_(torch.rand(param.shape, generator=gen) * 2 * bound - bound)
    return linear
