"""MixtureOfExperts: shared layers plus one expert whose parameters differ on every rank.

    Linear(8, 12) -> [shared Linear(12, 23)] -> [expert Linear(23, 12)] -> Linear(12, 8)

The expert is wrapped on a one-rank process group (`wrap(expert, process_group=expert_group)`),
so its gradients are never averaged across ranks; its parameters carry `param.expert = True`.
The unwrapped reference (`wrap=None`, usually inside `DummyDDP`) reduces the non-expert
gradients itself in `run_backward`. `delay_before_free_ms` delays the expert's free of its
unsharded parameters (through the wrap's `delay_before_free` hook).

    model = MixtureOfExperts(group, wrap=adapter.wrapper(), delay_before_free_ms=10)
    root = adapter.wrap(model)
    (x,) = model.get_input(device)               # (4, 8)
    model.run_backward(model.get_loss((x,), root(x)))
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext
from typing import Any, ClassVar

import torch
import torch.distributed as dist
from torch import nn

from .delay import sleep_ms
from .model_base import (
    DelayHooks,
    DeviceInit,
    Wrap,
    generator,
    maybe_wrap,
    move_before_wrap,
    run_loss_backward,
    seeded_init_,
)


class MixtureOfExperts(nn.Module):
    """The MixtureOfExperts of torch's FSDP test models (common_fsdp.py).

    Args:
        group: the process group of the shared layers.
        wrap: wraps the shared layer (on `group`) and the expert (on `expert_group`);
            None = unwrapped reference.
        delay_before_free_ms: delay before the expert frees its unsharded parameters
            (needs a wrap with `delay_before_free`, see `DelayHooks`).
        expert_group: the expert's one-rank group; default: `dist.new_group([rank])`,
            created only when wrapping (collective: every rank must build the model).
        device_init: when to move to `device` (DeviceInit.BEFORE moves before wrapping).
        device: the compute device for DeviceInit.BEFORE.
    """

    ROOT_WRAP_CONFIG: ClassVar[dict[str, Any]] = {}  # nothing special for the caller's root wrap

    def __init__(
        self,
        group: Any,
        wrap: Wrap | None = None,
        *,
        delay_before_free_ms: float = 0,
        expert_group: Any = None,
        device_init: DeviceInit = DeviceInit.AFTER,
        device: torch.device | None = None,
    ) -> None:
        super().__init__()
        self.group = group
        self.rank = group.rank()
        self.world_size = group.size()
        self.wrapped = wrap is not None
        self.delay_before_free_ms = delay_before_free_ms
        if delay_before_free_ms > 0 and wrap is not None and not isinstance(wrap, DelayHooks):
            raise TypeError(
                f"MixtureOfExperts(delay_before_free_ms={delay_before_free_ms}) needs a wrap with "
                f"a `delay_before_free(instance, delay)` hook; got {wrap!r}. Pass "
                "`adapter.wrapper(...)`, or delay_before_free_ms=0."
            )
        self._wrap = wrap
        d_input, d_shared, d_expert = 8, 12, 23

        expert = seeded_init_(nn.Linear(d_expert, d_shared), seed=42 + self.rank)  # per rank
        self.num_expert_params = sum(p.numel() for p in expert.parameters())
        for param in expert.parameters():
            param.expert = True  # type: ignore[attr-defined]
        shared = seeded_init_(nn.Linear(d_shared, d_expert), seed=0)  # identical on every rank
        first = seeded_init_(nn.Linear(d_input, d_shared), seed=1)
        last = seeded_init_(nn.Linear(d_shared, d_input), seed=2)
        for module in (expert, shared, first, last):
            move_before_wrap(module, device_init, device)

        if wrap is not None:
            if expert_group is None:
                expert_group = dist.new_group([self.rank])  # world size 1: never sharded
            expert = maybe_wrap(wrap, expert, process_group=expert_group)
            shared = maybe_wrap(wrap, shared, process_group=group)
        self.module = nn.Sequential(
            first,  # (4, 8) -> (4, 12)
            shared,  # -> (4, 23)
            expert,  # -> (4, 12)
            last,  # -> (4, 8)
        )

    def get_input(self, device: torch.device) -> tuple[torch.Tensor]:
        return (torch.rand(4, 8, generator=generator(1 + self.rank)).to(device),)  # (B=4, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        delayed_free = nullcontext()
        if self.delay_before_free_ms > 0 and self._wrap is not None:
            ms, device = self.delay_before_free_ms, x.device
            delayed_free = self._wrap.delay_before_free(
                self.module[2], lambda: sleep_ms(ms, device)
            )
        with delayed_free:
            return self.module(x)

    def get_loss(self, input: tuple[torch.Tensor], output: torch.Tensor) -> torch.Tensor:
        return output.sum()

    def run_backward(
        self, loss: torch.Tensor, backward: Callable[[torch.Tensor], None] | None = None
    ) -> None:
        run_loss_backward(loss, backward)
        if self.wrapped:
            return
        # The unwrapped reference averages the shared gradients itself (experts stay local).
        with torch.no_grad():
            for param in self.parameters():
                if getattr(param, "expert", False) or param.grad is None:
                    continue
                param.grad.div_(self.world_size)
                dist.all_reduce(param.grad, group=self.group)
