"""``FSDPTest``: a ``unittest.TestCase`` base whose ``test_*`` bodies run in every rank,
plus the helpers of torch's FSDP test utilities, in the shape of the seed
(pytorch #70235, ``test/distributed/fsdp``), but CPU-capable.

    class TestAllReduce(FSDPTest):
        def test_sum(self):
            t = torch.ones(1) * self.rank
            dist.all_reduce(t)
            self.assertEqual(t.item(), sum(range(self.world_size)))

Runs under pytest (with the plugin's ``--fsdp-mode`` / ``--fsdp-timeout``) and under plain
``python -m unittest`` (``FSDP_CONFORMANCE_MODE`` / ``FSDP_CONFORMANCE_TIMEOUT``).
"""

from __future__ import annotations

import enum
import functools
import itertools
import sys
import time
import unittest
from collections.abc import Callable
from typing import Any

from fsdp_conformance.world import gpus
from fsdp_conformance.world.protocol import FAILED, SKIPPED, XFAILED, TestTarget

# Hide this module's frames from unittest's and pytest's failure tracebacks.
__unittest = True


class FSDPInitMode(enum.Enum):
    """When the model moves to the rank's device relative to wrapping it in FSDP."""

    # Move model to the device before wrapping
    DEVICE_BEFORE = 1
    # Move model to the device after wrapping
    DEVICE_AFTER = 2
    # Don't move the model to the device at all
    DEVICE_NEVER = 3
    # The seed's names
    CUDA_BEFORE = 1  # noqa: PIE796  (alias of DEVICE_BEFORE)
    CUDA_AFTER = 2  # noqa: PIE796  (alias of DEVICE_AFTER)
    CUDA_NEVER = 3  # noqa: PIE796  (alias of DEVICE_NEVER)


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
    """Unsharded copies of ``model``'s parameters, in ``model.parameters()`` order.

    Works for the reference implementation and torch FSDP1 (through
    ``summon_full_params``), torch FSDP2 (DTensor ``full_tensor()``) and plain modules.

    Args:
        model: the (possibly FSDP-wrapped) root module.
    """
    import contextlib

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


@functools.cache
def get_cycles_per_ms() -> float:
    """GPU clock cycles per millisecond for ``torch.cuda._sleep``, calibrated once (median
    of several runs; CUDA only).

    Raises:
        RuntimeError: CUDA is not available.
    """
    import torch

    if not torch.cuda.is_available():
        raise RuntimeError("get_cycles_per_ms() needs CUDA; use device_sleep() on CPU")

    def measure() -> float:
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        torch.cuda._sleep(1_000_000)
        end.record()
        end.synchronize()
        return 1_000_000 / start.elapsed_time(end)

    runs = sorted(measure() for _ in range(10))
    return sum(runs[2:-2]) / len(runs[2:-2])


def device_sleep(ms: float, device: Any = None) -> None:
    """Occupy ``device`` for ``ms`` milliseconds: a ``cuda._sleep`` kernel on the current
    stream (asynchronous, like real work) on CUDA; ``time.sleep`` on CPU (the CPU is the device).

    Args:
        ms: milliseconds.
        device: torch.device or string; default: CUDA when available, else CPU.
    """
    import torch

    if device is None:
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda._sleep(int(ms * get_cycles_per_ms()))
    else:
        time.sleep(ms / 1000.0)


class FSDPTest(unittest.TestCase):
    """Base class whose ``test_*`` methods run in ``world_size`` ranks.

    Each rank instantiates the class for the test method, runs ``setUp``, the method and
    ``tearDown`` with the default process group initialised; ``self.rank``,
    ``self.world_size``, ``self.dist`` (the :class:`RankContext`) describe the rank.
    Class attributes ``fsdp_mode`` (None: the session's mode) and ``fsdp_timeout`` (None:
    the session's timeout) override per class.
    """

    # "process", "process-fresh", "thread" or None for the session default
    fsdp_mode: str | None = None
    # seconds, or None for the session default
    fsdp_timeout: float | None = None

    @property
    def world_size(self) -> int:
        """2 on CPU; the number of GPUs when there are at least two."""
        count = gpus.gpu_count()
        return count if count >= 2 and gpus.fake_gpu_count() is None else 2

    @property
    def dist(self) -> Any:
        """The rank's context (``rank``, ``group``, ``device``, ``backend``, ``tmp_path``)."""
        from fsdp_conformance.world.rank_main import current_context

        ctx = current_context()
        if ctx is None:
            raise RuntimeError(
                f"{type(self).__name__}.dist / .rank exist only while a test runs in its ranks"
            )
        return ctx

    @property
    def rank(self) -> int:
        return self.dist.rank

    @property
    def process_group(self) -> Any:
        return self.dist.group

    @property
    def device(self) -> Any:
        return self.dist.device

    @property
    def init_method(self) -> str:
        """The rendezvous URL of this rank set (``file://...`` FileStore; threads: ``threaded://``)."""
        return self.dist.init_method

    def run_subtests(
        self,
        subtest_config: dict[str, list[Any]],
        test_fn: Callable[..., None],
        *test_args: Any,
        **test_kwargs: Any,
    ) -> None:
        """Run ``test_fn`` for every combination of ``subtest_config``'s values, with a
        barrier between combinations. A failing combination is named in the failure.

        Args:
            subtest_config: keyword name -> list of values to try.
            test_fn: called as ``test_fn(*test_args, **test_kwargs, **combination)``.
        """
        keys = list(subtest_config)
        for values in itertools.product(*(subtest_config[k] for k in keys)):
            combination = dict(zip(keys, values))
            try:
                with self.subTest(**combination):
                    test_fn(*test_args, **test_kwargs, **combination)
            except Exception as exc:
                if hasattr(exc, "add_note"):
                    exc.add_note(f"in subtest {combination}")
                raise
            self.dist.barrier()

    # -------------------------------------------------------------------------
    # Dispatch: in the test process, a test method runs in the ranks instead.

    def run(self, result: Any = None) -> Any:
        from fsdp_conformance.world.rank_main import current_context

        if current_context() is not None:
            return super().run(result)  # in a rank
        name = self._testMethodName
        had_attr = name in self.__dict__
        previous = self.__dict__.get(name)
        setattr(self, name, functools.partial(_run_in_ranks, self, name))
        # setUp / tearDown run in the ranks, not here
        self.setUp = self.tearDown = _nothing  # type: ignore[method-assign]
        try:
            return super().run(result)
        finally:
            del self.setUp, self.tearDown
            if had_attr:
                setattr(self, name, previous)
            else:
                delattr(self, name)


def _nothing() -> None:
    pass


def _run_in_ranks(case: FSDPTest, method_name: str) -> None:
    from fsdp_conformance.world import runtime as runtime_module

    runtime = runtime_module.get_runtime()
    cls = type(case)
    module = sys.modules[cls.__module__]
    target = TestTarget(
        module_name=cls.__module__,
        module_file=getattr(module, "__file__", None),
        class_path=tuple(cls.__qualname__.split(".")),
        function_name=method_name,
        kind="unittest",
    )

    def thread_body(ctx: Any) -> None:
        cls(method_name).debug()

    request = runtime_module.TestRequest(
        target=target,
        kwargs={},
        test_id=case.id(),
        world_size=case.world_size,
        mode=case.fsdp_mode or runtime.options.mode,
        timeout=case.fsdp_timeout or runtime.options.timeout,
        thread_body=thread_body,
    )
    result = runtime.run(request)
    output = result.output() + "".join(f"fsdp-conformance: {note}\n" for note in result.notes)
    if output:
        sys.stdout.write(output)
    verdict = result.verdict
    if verdict.status in (SKIPPED, XFAILED):
        raise unittest.SkipTest(verdict.message)
    if verdict.status == FAILED:
        if "_pytest" in sys.modules and runtime_module.under_pytest():
            import pytest

            pytest.fail(verdict.message, pytrace=False)
        raise case.failureException(verdict.message)
