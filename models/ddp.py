"""DummyDDP: the reference for models that reduce their own gradients (MixtureOfExperts)."""

from __future__ import annotations

from typing import Any

from torch import nn


class DummyDDP(nn.Module):
    """Forwards to `module`; exposes it as `.module` like DistributedDataParallel."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)
