"""Layer: the building block of the overlap check (a module that sleeps a set time in forward).

layers = nn.Sequential(*[wrap(Layer(1_000_000, has_params=True)) for _ in range(4)])
y = layers(x); layers[0].module.get_time()   # ms of the last forward (device time on CUDA)
"""

from __future__ import annotations

import time
from typing import Any

import torch
from torch import nn

from .delay import sleep_cycles


class Layer(nn.Module):
    """Sleeps `compute_cycles` GPU sleep cycles in forward (CPU: nominal 1e6 cycles = 1 ms) and,
    with `has_params`, adds its own (1,)-shaped parameter, so wrapping it makes an instance with
    something to all-gather."""

    def __init__(self, compute_cycles: int, has_params: bool) -> None:
        super().__init__()
        self.compute_cycles = compute_cycles
        self.optional_param = nn.Parameter(torch.full((1,), 0.5)) if has_params else None
        self._timing: tuple = ()  # (start, end) events on CUDA, perf_counter seconds on CPU

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        start = _timestamp(x.device)
        sleep_cycles(self.compute_cycles, x.device)
        if self.optional_param is not None:
            x = x + self.optional_param
        self._timing = (start, _timestamp(x.device))
        return x

    def get_time(self) -> float:
        """Milliseconds the last forward took (CUDA: device time; synchronises its end event)."""
        if not self._timing:
            raise RuntimeError("Layer.get_time() called before any forward")
        start, end = self._timing
        if isinstance(start, float):
            return (end - start) * 1000.0
        end.synchronize()
        return start.elapsed_time(end)


def _timestamp(device: torch.device) -> Any:
    """A recorded timing event on CUDA (on the current stream), ``perf_counter`` seconds else."""
    if device.type != "cuda":
        return time.perf_counter()
    event = torch.cuda.Event(enable_timing=True)
    event.record()
    return event
