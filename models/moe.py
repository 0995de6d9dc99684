"""MixtureOfExperts: shared layers plus one expert whose parameters differ on every rank.

    Linear(8, 12) -> [shared Linear(12, 23)] -> [expert Linear(23, 12)] -> Linear(12, 8)

The expert is wrapped on a one-rank process group, so its gradients are never averaged; its
parameters carry `param.expert = True`. The unwrapped reference (usually inside `DummyDDP`)
averages the non-expert gradients itself in `run_backward`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .model_base import (
    DeviceInit,
    Wrap,
    ZooModel,
    delayed,
    maybe_wrap,
    move_before_wrap,
    rand_input,
    require_delay_hooks,
    run_loss_backward,
    seeded_init_,
)


class MixtureOfExperts(ZooModel):
    """The MixtureOfExperts of torch's FSDP test models (common_fsdp.py).

    Args:
        wrap: wraps the shared layer (on `group`) and the expert (on `expert_group`).
        delay_before_free_ms: delay before the expert frees its unsharded parameters
            (needs a wrap with `delay_before_free`, see `DelayHooks`).
        expert_group: the expert's one-rank group; default: `dist.new_group([rank])` when
            wrapping (collective: every rank must build the model).
    """

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
        super().__init__(group)
        self.group = group
        self.delay_before_free_ms = delay_before_free_ms
        require_delay_hooks("MixtureOfExperts", "delay_before_free_ms", delay_before_free_ms, wrap)
        self._wrap = wrap
        d_input, d_shared, d_expert = 8, 12, 23
        expert = seeded_init_(nn.Linear(d_expert, d_shared), seed=42 + self.rank)  # per rank
        self.num_expert_params = sum(p.numel() for p in expert.parameters())
        for param in expert.parameters():
            param.expert = True  # type: ignore[attr-defined]
        shared = seeded_init_(nn.Linear(d_shared, d_expert), seed=0)
        first = seeded_init_(nn.Linear(d_input, d_shared), seed=1)
        last = seeded_init_(nn.Linear(d_shared, d_input), seed=2)
        for module in (expert, shared, first, last):
            move_before_wrap(module, device_init, device)
        if wrap is not None:
            if expert_group is None:
                expert_group = dist.new_group([self.rank])
            expert = maybe_wrap(wrap, expert, process_group=expert_group)
            shared = maybe_wrap(wrap, shared, process_group=group)
        self.module = nn.Sequential(first, shared, expert, last)

    def get_input(self, device: torch.device) -> tuple[torch.Tensor]:
        return rand_input(1 + self.rank, device, 4, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        expert = self.module[2]
        with delayed(self._wrap, self.delay_before_free_ms, x.device, "delay_before_free", expert):
            return self.module(x)

    def get_loss(self, input: tuple[torch.Tensor], output: torch.Tensor) -> torch.Tensor:
        return output.sum()

    def run_backward(
        self, loss: torch.Tensor, backward: Callable[[torch.Tensor], None] | None = None
    ) -> None:
        run_loss_backward(loss, backward)
        if self._wrap is not None:
            return
        # the unwrapped reference averages the shared gradients itself (experts stay local)
        with torch.no_grad():
            for param in self.parameters():
                if getattr(param, "expert", False) or param.grad is None:
                    continue
                param.grad.div_(self.world_size)
                dist.all_reduce(param.grad, group=self.group)
