"""Small models and the DDP-parity harness for the reference FSDP's tests.

Self-contained on purpose (the model zoo is a separate package). Every model takes
``group`` and ``wrap`` (``wrap(module, **overrides) -> nn.Module``; ``None``: no wrapping,
the DDP reference) and provides ``get_input``, ``get_loss`` and ``run_backward``.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from fsdp_conformance.impl import FullyShardedDataParallel as FSDP

Wrap = Callable[..., nn.Module]


class SumLossStack(nn.Module):
    """``self.module`` on a (4, 8) input seeded per rank; the loss is the output's sum."""

    def get_input(self, device: torch.device) -> tuple[torch.Tensor, ...]:
        generator = torch.Generator().manual_seed(1 + self.rank)
        return (torch.rand(4, 8, generator=generator).to(device),)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.module(x)

    def get_loss(self, inputs: Any, output: torch.Tensor) -> torch.Tensor:
        return output.sum()

    def run_backward(self, loss: torch.Tensor) -> None:
        loss.backward()


class NestedSequential(SumLossStack):
    """Linear layers with an inner instance nested in an outer one (seed's NestedWrappedModule)."""

    def __init__(self, group: Any, wrap: Wrap | None) -> None:
        super().__init__()
        self.rank = group.rank()
        w = wrap or (lambda m, **_: m)
        torch.manual_seed(0)
        self.module = nn.Sequential(
            nn.Linear(8, 4),
            w(nn.Sequential(w(nn.Linear(4, 16)), nn.Linear(16, 16))),
            w(nn.Linear(16, 4)),
            nn.Linear(4, 8),
        )


class FlatSequential(NestedSequential):
    """Four sibling Linear instances under the root (the limiter's favourite shape)."""

    def __init__(self, group: Any, wrap: Wrap | None, width: int = 8) -> None:
        nn.Module.__init__(self)
        self.rank = group.rank()
        w = wrap or (lambda m, **_: m)
        torch.manual_seed(0)
        self.module = nn.Sequential(*(w(nn.Linear(width, width)) for _ in range(4)))


class TiedTransformer(nn.Module):
    """Embedding tied to the output projection, two encoder/decoder layers (each wrapped)."""

    def __init__(self, group: Any, wrap: Wrap | None, d_vocab: int = 23, d_model: int = 16) -> None:
        super().__init__()
        self.rank = group.rank()
        w = wrap or (lambda m, **_: m)
        torch.manual_seed(0)
        self.embed_tokens = nn.Embedding(d_vocab, d_model)
        self.transformer = nn.Transformer(
            d_model=d_model,
            nhead=2,
            num_encoder_layers=2,
            num_decoder_layers=2,
            dim_feedforward=8,
            dropout=0.1,
        )
        for stack in (self.transformer.encoder.layers, self.transformer.decoder.layers):
            for index in range(len(stack)):
                stack[index] = w(stack[index])
        self.output_proj = nn.Linear(d_model, d_vocab)
        self.output_proj.weight = self.embed_tokens.weight  # tied
        self.register_buffer("vocab_bias", torch.ones(d_model))
        self.register_buffer("long_buffer", torch.zeros(d_model, dtype=torch.long))

    def get_input(self, device: torch.device) -> tuple[torch.Tensor, ...]:
        torch.manual_seed(1 + self.rank)  # dropout stream, identical for FSDP and DDP
        src = torch.arange(12, device=device).view(6, 2)  # (S, B)
        tgt = torch.arange(8, device=device).view(4, 2)  # (T, B)
        return src, tgt

    def forward(self, src_ids: torch.Tensor, tgt_ids: torch.Tensor) -> torch.Tensor:
        src = (
            self.embed_tokens(src_ids) + self.vocab_bias + self.long_buffer.type_as(self.vocab_bias)
        )
        tgt = self.embed_tokens(tgt_ids)
        return self.output_proj(self.transformer(src, tgt))  # (T, B, V)

    def get_loss(self, inputs: Any, output: torch.Tensor) -> torch.Tensor:
        _, tgt = inputs
        return nn.functional.cross_entropy(
            output.view(-1, output.size(-1)), tgt.view(-1), reduction="sum"
        )

    def run_backward(self, loss: torch.Tensor) -> None:
        loss.backward()


class MixtureOfExperts(SumLossStack):
    """A shared layer and a per-rank expert wrapped with a one-rank process group."""

    def __init__(self, group: Any, wrap: Wrap | None, expert_group: Any = None) -> None:
        super().__init__()
        self.rank = group.rank()
        self.world_size = group.size()
        self.group = group
        self.wrapped = wrap is not None
        w = wrap or (lambda m, **_: m)
        torch.manual_seed(42 + self.rank)  # expert differs per rank
        expert = nn.Linear(23, 12)
        for param in expert.parameters():
            param.expert = True
        torch.manual_seed(0)
        shared = nn.Linear(12, 23)
        if self.wrapped:
            expert = w(expert, process_group=expert_group)
            shared = w(shared)
        self.module = nn.Sequential(nn.Linear(8, 12), shared, expert, nn.Linear(12, 8))

    def run_backward(self, loss: torch.Tensor) -> None:
        loss.backward()
        if not self.wrapped:  # reference: all-reduce the shared (non-expert) grads only
            with torch.no_grad():
                for param in self.parameters():
                    if not hasattr(param, "expert"):
                        param.grad.div_(self.world_size)
                        dist.all_reduce(param.grad, group=self.group)


class DummyDDP(nn.Module):
    """A DDP stand-in that does not reduce (the MoE reference reduces by hand)."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module

    def forward(self, *args: Any) -> Any:
        return self.module(*args)


def expert_group_for_rank(world_size: int) -> Any:
    """One single-rank group per rank (every rank must create every group)."""
    groups = [dist.new_group([r]) for r in range(world_size)]
    return groups[dist.get_rank()]


def train(
    model: nn.Module, steps: int = 3, lr: float = 0.01, check: Callable | None = None
) -> list[torch.Tensor]:
    """SGD+momentum(0.9) steps; returns the detached losses (fp32)."""
    inner = model.module
    optim = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    losses = []
    for _ in range(steps):
        optim.zero_grad()
        inputs = inner.get_input(torch.device("cpu"))
        output = model(*inputs)
        loss = inner.get_loss(inputs, output).float()
        inner.run_backward(loss)
        if check is not None:
            check(model)
        optim.step()
        losses.append(loss.detach())
    return losses


def reference_run(
    make: Callable[[Wrap | None], nn.Module], steps: int = 3, ddp: bool = True
) -> tuple[list, dict]:
    """Losses and final state dict of the unwrapped model under DDP (or DummyDDP)."""
    model = make(None)
    wrapped = nn.parallel.DistributedDataParallel(model) if ddp else DummyDDP(model)
    losses = train(wrapped, steps)
    return losses, copy.deepcopy(model.state_dict())


def fsdp_run(
    make: Callable[[Wrap | None], nn.Module],
    steps: int = 3,
    check: Callable | None = None,
    **config: Any,
) -> tuple[list, dict, FSDP]:
    """Losses and final full state dict of the model under the reference FSDP."""

    def wrap(module: nn.Module, **overrides: Any) -> nn.Module:
        return FSDP(module, **{**config, **overrides})

    model = FSDP(make(wrap), **config)
    losses = train(model, steps, check=check)
    return losses, model.state_dict(), model
