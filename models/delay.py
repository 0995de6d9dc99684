"""A delay that really delays, on CUDA and on CPU.

torch's test zoo delays with ``torch.cuda._sleep`` only, so its "delayed" models are not delayed
at all on a CPU-only host. ``sleep_ms(ms, device)`` is the one primitive the zoo uses:

- CUDA: enqueue ``torch.cuda._sleep(cycles)`` on the current stream (the CPU thread runs ahead,
  as it does in real training); the cycles per millisecond are calibrated once per process.
- CPU:  ``time.sleep`` — the CPU *is* the device, so blocking the calling thread is the delay.
"""

from __future__ import annotations

import time

import torch

# `Layer(compute_cycles, ...)` speaks in GPU sleep cycles (the CUDA overlap check's). On CPU a cycle
# count is turned into wall time with this nominal clock (1 GHz): 1e6 cycles = 1 ms.
NOMINAL_CPU_CYCLES_PER_MS = 1_000_000.0

_cuda_cycles_per_ms: float | None = None  # calibrated lazily, once per process


def cycles_per_ms(device: torch.device | str) -> float:
    """Cycles of ``torch.cuda._sleep`` per millisecond on ``device`` (nominal on CPU)."""
    device = torch.device(device)
    if device.type != "cuda":
        return NOMINAL_CPU_CYCLES_PER_MS
    global _cuda_cycles_per_ms
    if _cuda_cycles_per_ms is None:
        _cuda_cycles_per_ms = _calibrate_cuda(device)
    return _cuda_cycles_per_ms


def _calibrate_cuda(device: torch.device, test_cycles: int = 1_000_000, repeats: int = 5) -> float:
    """Median of ``repeats`` timed ``torch.cuda._sleep(test_cycles)`` runs, after a warm-up."""
    rates = []
    with torch.cuda.device(device):
        torch.cuda._sleep(test_cycles)  # warm-up: the first launch pays for module loading
        for _ in range(repeats):
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            torch.cuda._sleep(test_cycles)
            end.record()
            end.synchronize()
            rates.append(test_cycles / start.elapsed_time(end))
    rates.sort()
    return rates[len(rates) // 2]


def sleep_ms(ms: float, device: torch.device | str) -> None:
    """Delay ``device`` by ``ms`` milliseconds (CUDA: on the current stream; CPU: this thread)."""
    if ms <= 0:
        return
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda._sleep(int(ms * cycles_per_ms(device)))
    else:
        time.sleep(ms / 1000.0)


def sleep_cycles(cycles: int, device: torch.device | str) -> None:
    """Delay ``device`` by ``cycles`` GPU sleep cycles (on CPU: at the nominal clock)."""
    if cycles <= 0:
        return
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda._sleep(int(cycles))
    else:
        time.sleep(cycles / NOMINAL_CPU_CYCLES_PER_MS / 1000.0)
