"""Models for the training-loop checks: per-instance gradient scales, a skippable branch,
frozen parameters, and non-reentrant activation checkpointing inside wrapped blocks.

    LoopModule: Linear(8, 16) -> [block 0] -> [block 1] -> [block 2] -> ([branch]) -> [head]
    (brackets = wrapped; block i = Sequential(Linear(16, 16), Tanh, Scale(gains[i])); with
    ``norm=True`` Sequential(linear=Linear(16, 16), norm=LayerNorm(16), act=Tanh, scale=...))

`gains` makes the instances' gradient magnitudes differ by orders of magnitude (the clipping
check's global norm then depends on every shard); `branch=True` adds a wrapped Linear(16, 16)
used only while `use_branch` is True (set by the caller, the same on every rank); `freeze`
makes block 0 frozen ("instance": the whole wrapped submodule) or its Linear weight only
("mixed": frozen and trainable parameters in one instance); `no_shard_block` wraps that block
with ``sharding_strategy="NO_SHARD"`` (NO_SHARD mixed with sharded instances).

`CheckpointingWrap(wrap)` is a zoo `wrap` that puts each wrapped block's module inside a
`CheckpointedModule` first: the FSDP instance runs ``torch.utils.checkpoint(use_reentrant=False)``
around its module, so every FSDP instance nested inside it is recomputed during backward;
`CheckpointingWrap(wrap, outside=True)` puts the checkpoint around the FSDP instance instead.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from typing import Any, ClassVar

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from .model_base import DeviceInit, Wrap, generator, maybe_wrap, move_before_wrap, run_loss_backward

# attribute the checkpoint wrapper keeps its module under: the adapters' name cleaning removes it
CHECKPOINTED = "_checkpoint_wrapped_module"


class CheckpointedModule(nn.Module):
    """Runs `module` under non-reentrant activation checkpointing (recomputed in backward)."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self._checkpoint_wrapped_module = module

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return checkpoint(self._checkpoint_wrapped_module, *args, use_reentrant=False, **kwargs)

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name == CHECKPOINTED:
                raise
            return getattr(self._checkpoint_wrapped_module, name)


class CheckpointingWrap:
    """A zoo `wrap` that checkpoints each wrapped module's forward and wraps it with `wrap`
    (None: checkpointing only, e.g. for a reference); the delay hooks forward to `wrap`.

    Args:
        wrap: the FSDP wrap.
        outside: False (default): the FSDP instance runs checkpoint around its module (torch's
            ``checkpoint_wrapper`` applied before wrapping); True: checkpoint runs around the
            FSDP instance, so the recompute re-enters the instance's own forward during its
            backward.
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
    """Multiplies by a constant (no parameters; with ``buffer``, a 0-dim floating-point buffer
    ``gain_buffer`` holds it)."""

    def __init__(self, gain: float, buffer: bool = False) -> None:
        super().__init__()
        self.gain = gain
        if buffer:
            self.register_buffer("gain_buffer", torch.tensor(float(gain)))
        else:
            self.gain_buffer = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * (self.gain if self.gain_buffer is None else self.gain_buffer)


class LoopModule(nn.Module):
    """The training-loop checks' model (see the module docstring).

    Args:
        group: the process group (its rank seeds the inputs).
        wrap: wraps the blocks, the branch and the head; None = unwrapped reference.
        gains: one per block, the block's output scale.
        branch: add the wrapped branch (used while `use_branch` is True).
        freeze: None, "instance" (block 0 entirely) or "mixed" (block 0's Linear weight).
        no_shard_block: index of a block wrapped with NO_SHARD (None: none).
        buffer: add floating-point buffers (what mixed precision's buffer_dtype casts): the
            root's ``offset``, added to the trunk's output, and each block's
            ``Scale.gain_buffer`` (inside the wrapped blocks).
        norm: blocks are ``Sequential(linear=Linear(16, 16), norm=LayerNorm(16), act=Tanh,
            scale=Scale)`` (named, for optimizer groups by name).
    """

    ROOT_WRAP_CONFIG: ClassVar[dict[str, Any]] = {}

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
        super().__init__()
        if freeze not in (None, "instance", "mixed"):
            raise ValueError(f"LoopModule freeze={freeze!r}: use None, 'instance' or 'mixed'")
        self.rank = group.rank()
        self.world_size = group.size()
        self.use_branch = branch  # the caller switches it (the same on every rank)
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
        branch_module = _init(nn.Linear(16, 16), gen)
        move_before_wrap(branch_module, device_init, device)
        self.branch = maybe_wrap(wrap, branch_module) if branch else None
        head = _init(nn.Linear(16, 8), gen)
        move_before_wrap(head, device_init, device)
        self.head = maybe_wrap(wrap, head)
        move_before_wrap(self.trunk, device_init, device)
        if buffer:
            at = device if device_init is DeviceInit.BEFORE else None
            self.register_buffer("offset", torch.linspace(-0.5, 0.5, 16, device=at))
        else:
            self.offset = None

    def get_input(self, device: torch.device) -> tuple[torch.Tensor]:
        return (torch.rand(4, 8, generator=generator(11 + self.rank)).to(device),)  # (B=4, 8)

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """The trunk and the blocks, without the head: a method other than forward (B, 16)."""
        x = torch.relu(self.trunk(x))
        if self.offset is not None:
            x = x + self.offset
        return self.blocks(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.encode(x)  # (B, 16)
        if self.branch is not None and self.use_branch:
            x = x + self.branch(x)
        return self.head(x)  # (B, 8)

    def get_loss(self, input: tuple[torch.Tensor], output: torch.Tensor) -> torch.Tensor:
        return output.square().sum()

    def run_backward(
        self, loss: torch.Tensor, backward: Callable[[torch.Tensor], None] | None = None
    ) -> None:
        run_loss_backward(loss, backward)


@torch.no_grad()
def _init(linear: nn.Linear, gen: torch.Generator) -> nn.Linear:
    bound = 1.0 / linear.in_features**0.5
    for param in (linear.weight, linear.bias):
        param.copy_(torch.rand(param.shape, generator=gen) * 2 * bound - bound)
    return linear
