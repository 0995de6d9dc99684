"""A delay that really delays, on CUDA and on CPU (torch's zoo used ``torch.cuda._sleep`` only).

CUDA: ``torch.cuda._sleep(cycles)`` enqueued on the current stream (the CPU runs ahead), with
the cycles per millisecond calibrated once per process. CPU: ``time.sleep`` (the CPU *is* the
device).
"""

from __future__ import annotations

import time

import torch

# On CPU, `Layer`'s GPU sleep cycles become wall time at this nominal clock (1 GHz)
NOMINAL_CPU_CYCLES_PER_MS = 1_000_000.0

_cuda_cycles_per_ms: float | None = None


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
    """Median rate of ``repeats`` timed ``torch.cuda._sleep(test_cycles)`` runs."""
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
    if ms > 0:
        sleep_cycles(ms * cycles_per_ms(device), device)


def sleep_cycles(cycles: int, device: torch.device | str) -> None:
    """Delay ``device`` by ``cycles`` GPU sleep cycles (on CPU: at the nominal clock)."""
    if cycles <= 0:
        return
    if torch.device(device).type == "cuda":
        torch.cuda._sleep(int(cycles))
    else:
        time.sleep(cycles / NOMINAL_CPU_CYCLES_PER_MS / 1000.0)
