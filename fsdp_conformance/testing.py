"""The FSDP test helpers of torch's FSDP test utilities (``test/distributed/fsdp``), CPU-capable:
``FSDPTest`` (the harness's ``RankTestCase``: every ``test_*`` body runs in every rank) and the
seed's helpers, built on the model zoo (docs/harness.md, "FSDPTest").
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from fsdp_conformance.harness.testcase import RankTestCase
from fsdp_conformance.models import DeviceInit, delay

# Hide this module's frames from unittest's and pytest's failure tracebacks.
__unittest = True

# When the model moves to the rank's device relative to wrapping it (BEFORE, AFTER, NEVER; the
# seed's DEVICE_* and CUDA_* names are aliases)
FSDPInitMode = DeviceInit

__all__ = [
    "DummyProcessGroup",
    "FSDPInitMode",
    "FSDPTest",
    "device_sleep",
    "get_cycles_per_ms",
    "get_full_params",
]


class FSDPTest(RankTestCase):
    """Base class whose ``test_*`` methods (with ``setUp`` and ``tearDown``) run in every one of
    ``world_size`` ranks (the seed's FSDPTest; see ``RankTestCase``)."""


class DummyProcessGroup:
    """A stand-in process group that only knows its rank and size."""

    def __init__(self, rank: int, size: int) -> None:
        self._rank = rank
        self._size = size

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._size


def get_full_params(model: Any) -> list[Any]:
    """Unsharded copies of the (possibly FSDP-wrapped) root ``model``'s parameters, in
    ``model.parameters()`` order: through ``summon_full_params`` (the reference implementation,
    torch FSDP1), DTensor ``full_tensor()`` (FSDP2), or as they are (plain modules)."""
    from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP

    if isinstance(model, TorchFSDP):
        context = TorchFSDP.summon_full_params(model)
    elif callable(getattr(model, "summon_full_params", None)):
        context = model.summon_full_params()
    else:
        context = contextlib.nullcontext()
    with context:
        return [
            (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
            for p in model.parameters()
        ]


def get_cycles_per_ms() -> float:
    """``torch.cuda._sleep`` cycles per millisecond on the current CUDA device, calibrated once
    per process (``models.delay.cycles_per_ms``); RuntimeError without CUDA."""
    if not torch.cuda.is_available():
        raise RuntimeError("get_cycles_per_ms() needs CUDA; use device_sleep() on CPU")
    return delay.cycles_per_ms(torch.device("cuda", torch.cuda.current_device()))


def device_sleep(ms: float, device: Any = None) -> None:
    """Occupy ``device`` (default: CUDA when available, else CPU) for ``ms`` milliseconds: an
    asynchronous ``cuda._sleep`` kernel on CUDA, ``time.sleep`` on CPU (``models.delay.sleep_ms``).
    """
    if device is None:
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    delay.sleep_ms(ms, device)
