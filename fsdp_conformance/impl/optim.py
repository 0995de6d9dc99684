"""Optimizer parameter groups by the original parameters' names, over flat parameters.

The optimizer holds one ``nn.Parameter`` per piece of an original parameter in this rank's shard,
sharing the shard's storage; before each step every piece's gradient is pointed at its slice of
the flat gradient, and ``zero_grad`` clears the flat gradients too. Parameters left unflattened
(frozen next to trainable ones) are handed over as they are.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from .state import fsdp_states

# (name, param) -> the options of its group, e.g. {"weight_decay": 0.0}
GroupOptions = Callable[[str, nn.Parameter], dict[str, Any]]


def optimizer(
    root: nn.Module,
    optimizer_class: type[torch.optim.Optimizer],
    group_options: GroupOptions,
    **defaults: Any,
) -> torch.optim.Optimizer:
    """``optimizer_class`` (updating in place: SGD, Adam, ...) over the root ``root``'s
    parameters, grouped by ``group_options(name, param)``: the name in the unwrapped module
    (``blocks.1.0.weight``; the parameter is a one-dimensional piece, so decide by the name) ->
    that group's options. ``defaults``: the optimizer's keyword arguments.
    """
    pieces = shard_pieces(root)
    groups: dict[tuple, dict[str, Any]] = {}
    for name, param, _ in pieces:
        options = group_options(name, param)
        if not isinstance(options, dict):
            raise TypeError(
                f"group_options({name!r}, ...) returned {options!r}; return a dict of optimizer "
                "options (e.g. {'weight_decay': 0.0}, or {} for the defaults)"
            )
        key = tuple(sorted(options.items()))
        groups.setdefault(key, {"params": [], **options})["params"].append(param)
    slices = [(param, source) for _, param, source in pieces if source is not None]
    flats = list({id(source[0]): source[0] for _, source in slices}.values())

    class ShardPieceOptimizer(optimizer_class):  # type: ignore[misc, valid-type]
        def step(self, closure: Any = None) -> Any:
            for param, (flat, start, end, _) in slices:
                param.grad = None if flat.grad is None else flat.grad[start:end]
            return super().step(closure)

        def zero_grad(self, set_to_none: bool = True) -> None:
            super().zero_grad(set_to_none)
            for flat in flats:
                if set_to_none:
                    flat.grad = None
                elif flat.grad is not None:
                    flat.grad.zero_()

    ShardPieceOptimizer.__name__ = optimizer_class.__name__
    return ShardPieceOptimizer(list(groups.values()), **defaults)


def shard_pieces(root: nn.Module) -> list[tuple[str, nn.Parameter, tuple | None]]:
    """(name, optimizer parameter, (flat parameter, start, end in its shard, start in the
    original parameter) or None) per original parameter with elements on this rank, in the
    model's order."""
    paths = {id(module): name for name, module in root.named_modules()}
    found: list[tuple[str, nn.Parameter, tuple | None]] = []
    flats = set()
    for state in fsdp_states(root):
        handle = state.handle
        if handle is None:
            continue
        flat = handle.flat_param
        flats.add(id(flat))
        low = handle.rank * handle.shard_numel if handle.sharded else 0
        high = low + flat.numel()
        offset = 0
        first_slot = {}
        for slot in handle.slots:
            first_slot.setdefault(slot.index, slot)
        for index, numel in enumerate(handle.numels):
            begin, offset = offset, offset + numel  # the parameter's place in the flat parameter
            start, end = max(begin, low), min(offset, high)
            if start >= end:
                continue
            slot = first_slot[index]
            name = _unwrapped(f"{paths[id(slot.module)]}.{slot.name}".lstrip("."))
            piece = nn.Parameter(flat.data[start - low : end - low], flat.requires_grad)
            found.append((name, piece, (flat, start - low, end - low, start - begin)))
    for name, param in root.named_parameters():
        if id(param) not in flats:  # left unflattened (frozen next to trainable parameters)
            found.append((_unwrapped(name), param, None))
    return found


def _unwrapped(name: str) -> str:
    """A parameter's name in the unwrapped model."""
    return name.replace("_fsdp_wrapped_module.", "")
