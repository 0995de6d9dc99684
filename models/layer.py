"""Layer: the building block of the overlap check (a Linear that sleeps a set time in forward).

A layer that "computes" for `compute_cycles` GPU sleep cycles (on CPU: the same time at the
nominal 1 GHz clock of `delay.NOMINAL_CPU_CYCLES_PER_MS`, by sleeping) and optionally owns one
parameter, so wrapping it makes an FSDP instance with something to all-gather.

    layers = nn.Sequential(*[wrap(Layer(1_000_000, has_params=True)) for _ in range(4)])
    y = layers(x); layers[0].module.get_time()   # ms of the last forward (device time on CUDA)
"""

from __future__ import annotations

import time

import torch
from torch import nn

from .delay import sleep_cycles


class Layer(nn.Module):
    """Sleeps `compute_cycles` in forward and adds its optional one-element parameter.

    Args:
        compute_cycles: GPU sleep cycles per forward (CPU: nominal 1e6 cycles = 1 ms).
        has_params: own a parameter of shape (1,) that is added to the input.
    """

    def __init__(self, compute_cycles: int, has_params: bool) -> None:
        super().__init__()
        self.compute_cycles = compute_cycles
        self.optional_param = nn.Parameter(torch.full((1,), 0.5)) if has_params else None
        self._timing: tuple = ()  # (start, end) events on CUDA, perf_counter seconds on CPU

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.device.type == "cuda":
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            sleep_cycles(self.compute_cycles, x.device)
            if self.optional_param is not None:
                x = x + self.optional_param  # the parameter takes part in the graph
            end.record()
            self._timing = (start, end)
            return x
        start_s = time.perf_counter()
        sleep_cycles(self.compute_cycles, x.device)
        if self.optional_param is not None:
            x = x + self.optional_param
        self._timing = (start_s, time.perf_counter())
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
