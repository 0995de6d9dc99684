"""Build the ``nn.Module`` a ``ModelSpec`` describes ([Note: the generated model] in spec.py).

Parameters are created with ``torch.nn.utils.skip_init`` (no draw from the global RNG) and
filled from a generator seeded with the spec's seed, so every rank (and the DDP reference)
builds bit-identical weights from the spec alone.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from fsdp_conformance.models.model_base import run_loss_backward

from .spec import Block, ModelSpec, Seq, final_width

HEAD_WIDTH = 2


@dataclasses.dataclass
class Packed:
    """The "dataclass" output container (an ordinary, unregistered dataclass, as users write)."""

    h: torch.Tensor
    note: str = "packed"


# output kind -> ``h`` in that container (with a non-tensor companion where there is room)
_PACK = {
    "tensor": lambda h: h,
    "tuple": lambda h: (h, 1),
    "list": lambda h: [h],
    "dict": lambda h: {"h": h, "n": 3},
    "dataclass": Packed,
}


def pack(h: torch.Tensor, kind: str) -> Any:
    if kind not in _PACK:
        raise ValueError(f"unknown output kind {kind!r}")
    return _PACK[kind](h)


def unpack(output: Any) -> torch.Tensor:
    """The tensor ``pack`` put in ``output``."""
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, (tuple, list)):
        return output[0]
    if isinstance(output, dict):
        return output["h"]
    if isinstance(output, Packed):
        return output.h
    raise TypeError(f"unexpected node output {type(output).__name__}")


class FuzzBlock(nn.Module):
    """A leaf node."""

    def __init__(self, spec: Block) -> None:
        super().__init__()
        self.spec = spec
        width = spec.width_in
        if spec.kind == "linear":
            self.lin = nn.utils.skip_init(nn.Linear, width, spec.width_out, bias=spec.bias)
        elif spec.kind == "layernorm":
            self.norm = nn.utils.skip_init(nn.LayerNorm, width)
        elif spec.kind == "embed":
            self.emb = nn.utils.skip_init(nn.Embedding, spec.vocab, width)
        elif spec.kind in ("twice", "branch"):
            self.lin = nn.utils.skip_init(nn.Linear, width, width)

    def forward(self, h: torch.Tensor, tokens: torch.Tensor, it: int) -> Any:
        kind = self.spec.kind
        if kind == "linear":
            h = self.lin(h)
        elif kind == "layernorm":
            h = self.norm(h)
        elif kind == "act":
            h = torch.tanh(h)
        elif kind == "embed":
            h = h + self.emb(tokens % self.spec.vocab)
        elif kind == "twice":
            h = h + self.lin(torch.tanh(self.lin(h)))
        elif kind == "branch" and it % self.spec.period == 0:
            h = h + self.lin(h)
        return pack(h, self.spec.output)


class FuzzSeq(nn.Module):
    """A container node; a child whose spec says so runs under activation checkpointing."""

    def __init__(self, spec: Seq) -> None:
        super().__init__()
        self.spec = spec
        self.nodes = nn.ModuleList(
            FuzzSeq(node) if isinstance(node, Seq) else FuzzBlock(node) for node in spec.nodes
        )

    def forward(self, h: torch.Tensor, tokens: torch.Tensor, it: int) -> Any:
        for spec, node in zip(self.spec.nodes, self.nodes):
            if spec.checkpoint and torch.is_grad_enabled():
                h = unpack(checkpoint(node, h, tokens, it, use_reentrant=False))
            else:
                h = unpack(node(h, tokens, it))
        return pack(h, self.spec.output)


class FuzzModel(nn.Module):
    """The generated model: ``body`` then a trainable ``head``; ``run_backward`` as the zoo's
    models (what ``training.Driver`` calls)."""

    run_backward = staticmethod(run_loss_backward)

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.spec = spec
        self.body = FuzzSeq(spec.body)
        self.head = nn.utils.skip_init(nn.Linear, final_width(spec), HEAD_WIDTH)

    def forward(self, x: torch.Tensor, tokens: torch.Tensor, it: int) -> Any:
        h = unpack(self.body(x, tokens, it))
        return pack(self.head(h), self.spec.output)


def build_model(spec: ModelSpec, device: torch.device | str = "cpu") -> FuzzModel:
    """The model of ``spec`` with its deterministic weights, ties and frozen blocks, on
    ``device`` (``"meta"``: the same modules and ties, every tensor on the meta device)."""
    model = FuzzModel(spec)
    generator = torch.Generator().manual_seed(spec.seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                values = 1.0 + 0.1 * torch.randn(param.shape, generator=generator)
            else:
                fan_in = param.shape[-1] if param.dim() > 1 else max(1, param.shape[0])
                values = torch.randn(param.shape, generator=generator) / math.sqrt(fan_in)
            param.copy_(values)
    if torch.device(device).type == "meta":
        model = model.to("meta")  # before tying: a conversion would untie
    ties: dict[int, nn.Parameter] = {}
    for module in model.modules():
        if isinstance(module, FuzzBlock):
            if module.spec.tie:
                module.lin.weight = ties.setdefault(module.spec.tie, module.lin.weight)
            if module.spec.frozen:
                module.requires_grad_(False)
    return model.to(device)


def make_batch(
    model: ModelSpec, batch: int, data_seed: int, rank: int, index: int, device: Any
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s ``index``-th input batch: (x of shape (batch, width), int64 tokens)."""
    seed = (data_seed * 1_000_003 + rank * 10_007 + index * 101 + 17) % (2**62)
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, model.width, generator=generator)
    tokens = torch.randint(0, 64, (batch,), generator=generator)
    return x.to(device), tokens.to(device)
