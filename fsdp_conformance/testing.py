"""The FSDP test helpers of torch's FSDP test utilities, in the shape of the seed (pytorch
#70235, ``test/distributed/fsdp``), but CPU-capable.

    class TestAllReduce(FSDPTest):
        def test_sum(self):
            t = torch.ones(1) * self.rank
            dist.all_reduce(t)
            self.assertEqual(t.item(), sum(range(self.world_size)))

``FSDPTest`` is the rank test case of ``fsdp_conformance.harness`` (``RankTestCase``: every
``test_*`` body runs in every rank, under pytest or plain ``python -m unittest``); the rest are
the seed's helpers: ``FSDPInitMode`` (the model zoo's ``DeviceInit``), ``DummyProcessGroup``,
``get_full_params``, and the CUDA sleep of the zoo's delay (``get_cycles_per_ms``,
``device_sleep``). ``fsdp_conformance.FSDPTest`` names the same class.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from fsdp_conformance.harness.testcase import RankTestCase
from fsdp_conformance.models import DeviceInit, delay

# Hide this module's frames from unittest's and pytest's failure tracebacks.
__unittest = True

# When the model moves to the rank's device relative to wrapping it in FSDP: the zoo's
# ``DeviceInit`` (members BEFORE, AFTER, NEVER; the seed's names DEVICE_* and CUDA_* are aliases)
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
    """Base class whose ``test_*`` methods run in ``world_size`` ranks (the seed's FSDPTest).

    Each rank instantiates the class for the test method, runs ``setUp``, the method and
    ``tearDown`` with the default process group initialised; ``self.rank``,
    ``self.world_size``, ``self.dist`` (the :class:`RankContext`) describe the rank.
    Class attributes ``fsdp_mode`` (None: the session's mode) and ``fsdp_timeout`` (None:
    the session's timeout) override per class.
    """


class DummyProcessGroup:
    """A stand-in process group that only knows its rank and size.

    Args:
        rank: the rank it reports.
        size: the size it reports.
    """

    def __init__(self, rank: int, size: int) -> None:
        self._rank = rank
        self._size = size

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._size


def get_full_params(model: Any) -> list[Any]:
    """Unsharded copies of ``model``'s parameters, in ``model.parameters()`` order.

    Works for the reference implementation and torch FSDP1 (through
    ``summon_full_params``), torch FSDP2 (DTensor ``full_tensor()``) and plain modules.

    Args:
        model: the (possibly FSDP-wrapped) root module.
    """
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP
    except ImportError:  # pragma: no cover
        TorchFSDP = None
    if TorchFSDP is not None and isinstance(model, TorchFSDP):
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
    per process (the zoo's calibration, ``fsdp_conformance.models.delay.cycles_per_ms``).

    Raises:
        RuntimeError: CUDA is not available.
    """
    if not torch.cuda.is_available():
        raise RuntimeError("get_cycles_per_ms() needs CUDA; use device_sleep() on CPU")
    return delay.cycles_per_ms(torch.device("cuda", torch.cuda.current_device()))


def device_sleep(ms: float, device: Any = None) -> None:
    """Occupy ``device`` for ``ms`` milliseconds: a ``cuda._sleep`` kernel on the current
    stream (asynchronous, like real work) on CUDA; ``time.sleep`` on CPU (the CPU is the device).
    The zoo's delay (``fsdp_conformance.models.delay.sleep_ms``).

    Args:
        ms: milliseconds.
        device: torch.device or string; default: CUDA when available, else CPU.
    """
    if device is None:
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    delay.sleep_ms(ms, device)
