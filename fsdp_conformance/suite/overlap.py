"""Measuring communication/computation overlap; the check is ``BaseOverlapTests``
(test_overlap.py).

[Note: overlap timing]
``LAYERS`` wrapped ``models.Layer``s "compute" ``compute`` ms each in forward; every all-gather
is delayed by ``comm`` ms. Four cases (nothing / all-gather only / compute only / both) are
timed round-robin ``REPEATS`` times after iteration 1; each statistic is the minimum over
repeats and the maximum over ranks (every rank decides alike); a failure is measured again.
CPU (gloo): ``delayed_all_gathers`` returns a ``DelayedWork`` whose ``wait()`` returns no
earlier than issue + ``comm``; the overlapped extra time over "nothing" must be at most
``MAX_OVERLAP_RATIO`` of communication + computation serialised. Synchronous all-gathers
(``async_op=False``) cannot overlap: the check skips. CUDA (nccl): both delays are
``torch.cuda._sleep``, times are device times (``cuda_overlap_failure``)."""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed as tdist
from torch import nn

from fsdp_conformance._patching import patch_attribute
from fsdp_conformance.adapters import features as adapter_features
from fsdp_conformance.checks import CheckFailure
from fsdp_conformance.constants import Op
from fsdp_conformance.models import Layer, delay

LAYERS = 4
REPEATS = 4
# CPU delays (ms): generous, so that scheduling noise on a loaded 2-core machine stays small
CPU_COMPUTE_MS = 30.0
CPU_COMM_MS = 30.0
MAX_OVERLAP_RATIO = 0.8
CUDA_COMPUTE_MS = 20.0
CUDA_COMM_MS = 20.0
SHORT_TO_LONG = 10.0
BOTH_MARGIN = 1.1
CASES = ("nothing", Op.ALL_GATHER.value, "compute", "both")
# ProcessGroup methods every torch.distributed all-gather calls (torch 2.13.0)
ALL_GATHER_METHODS = ("all_gather_single", "_allgather_base", "allgather")
# the patches stay installed while any thread is inside delayed_all_gathers
_DELAY_KEY = "fsdp-conformance overlap: delayed all-gathers"
_delay_lock = threading.Lock()
_delaying_threads = 0
# per thread: (delay_ms, device, AllGatherLog) of the delayed_all_gathers block it is in
_delay = threading.local()


class DelayedWork:
    """A collective's work handle whose ``wait()`` returns no earlier than ``deadline``."""

    def __init__(self, work: Any, deadline: float) -> None:
        self._work = work
        self.deadline = deadline  # a time.perf_counter() value

    def wait(self, *args: Any, **kwargs: Any) -> bool:
        result = self._work.wait(*args, **kwargs)
        remaining = self.deadline - time.perf_counter()
        if remaining > 0:
            time.sleep(remaining)
        return result

    def is_completed(self) -> bool:
        return self._work.is_completed() and time.perf_counter() >= self.deadline

    def __getattr__(self, name: str) -> Any:
        return getattr(self._work, name)


@dataclasses.dataclass
class AllGatherLog:
    """What ``delayed_all_gathers`` saw while active."""

    issued: int = 0
    synchronous: int = 0  # async_op=False: torch.distributed waits at once, no overlap possible


@contextlib.contextmanager
def delayed_all_gathers(
    delay_ms: float, device: torch.device | None = None
) -> Iterator[AllGatherLog]:
    """While active, every all-gather of this thread completes ``delay_ms`` late: a
    ``DelayedWork`` on CPU, ``torch.cuda._sleep`` on the issuing stream first on CUDA."""
    global _delaying_threads
    log = AllGatherLog()
    cls = tdist.ProcessGroup
    with _delay_lock:
        records = [
            patch_attribute(cls, name, _delayed, key=_DELAY_KEY, written_for="torch 2.13.0")
            for name in ALL_GATHER_METHODS
            if name in vars(cls)
        ]
        _delaying_threads += 1
    _delay.settings = (delay_ms, device, log)
    try:
        yield log
    finally:
        _delay.settings = None
        with _delay_lock:
            _delaying_threads -= 1
            if not _delaying_threads:  # the last thread inside a block takes the patches off
                for record in records:
                    record.undo()


def _delayed(original: Any) -> Any:
    """``original`` delayed in a thread inside ``delayed_all_gathers``, unchanged elsewhere."""

    def method(self: Any, *args: Any) -> Any:
        settings = getattr(_delay, "settings", None)
        if settings is None:
            return original(self, *args)
        delay_ms, device, log = settings
        log.issued += 1
        options = args[-1] if args else None
        if getattr(options, "asyncOp", True) is False:
            log.synchronous += 1
        if device is not None and device.type == "cuda":
            delay.sleep_ms(delay_ms, device)
            return original(self, *args)
        deadline = time.perf_counter() + delay_ms / 1000.0
        return DelayedWork(original(self, *args), deadline)

    return method


@dataclasses.dataclass
class OverlapTimes:
    """Min-k forward times (ms) of the four cases, max over ranks; the all-gathers one forward
    of the "both" case issued, and how many of them were synchronous."""

    nothing: float
    all_gather: float
    compute: float
    both: float
    all_gathers: int
    synchronous: int

    def cpu_ratio(self, comm_ms: float) -> float:
        """Overlapped extra time / (communication + computation serialised), CPU."""
        serialised = self.all_gathers * comm_ms + (self.compute - self.nothing)
        return (self.both - self.nothing) / serialised

    def describe(self) -> str:
        return (
            f"min forward ms: nothing {self.nothing:.1f}, all-gather only {self.all_gather:.1f}, "
            f"compute only {self.compute:.1f}, both {self.both:.1f}; {self.all_gathers} "
            f"all-gathers per forward ({self.synchronous} synchronous)"
        )


class _Chain(nn.Module):
    """``LAYERS`` wrapped ``Layer``s in a row (the root owns no parameters)."""

    def __init__(self, wrap: Any, compute_cycles: int) -> None:
        super().__init__()
        self.layers = nn.Sequential(
            *(wrap(Layer(compute_cycles, has_params=True)) for _ in range(LAYERS))
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)


def overlap_config(device: torch.device, limit_all_gathers: bool = False) -> dict[str, Any]:
    """The wrap config: on CPU with forward prefetch (the CPU thread blocks in compute); on CUDA
    the CPU runs ahead without it."""
    config: dict[str, Any] = {
        "sharding_strategy": "FULL_SHARD",
        "limit_all_gathers": limit_all_gathers,
    }
    if device.type == "cuda":
        config["device_id"] = device
    else:
        config["forward_prefetch"] = True
    return config


def measure_overlap(
    adapter: Any,
    dist: Any,
    compute_ms: float,
    comm_ms: float,
    repeats: int = REPEATS,
    limit_all_gathers: bool = False,
) -> OverlapTimes:
    """Time the four cases of [Note: overlap timing] (every rank calls it; collectives)."""
    device = dist.device
    config = overlap_config(device, limit_all_gathers)
    cycles = int(compute_ms * delay.cycles_per_ms(device))
    models = {}
    for case in CASES:
        wrap = adapter.wrapper(**config)
        compute_cycles = cycles if case in ("compute", "both") else 0
        model = adapter.wrap(_Chain(wrap, compute_cycles), root=True, **config)
        optimizer = adapter.optimizer(model, "sgd", lr=0.01)
        models[case] = (model, optimizer)
        _timed_forward(model, optimizer, device, 0.0, adapter)  # records the forward order
    times: dict[str, list[float]] = {case: [] for case in CASES}
    logs = {}
    for repeat in range(repeats):
        order = CASES[repeat % len(CASES) :] + CASES[: repeat % len(CASES)]  # interleave
        for case in order:
            model, optimizer = models[case]
            comm = comm_ms if case in (Op.ALL_GATHER, "both") else 0.0
            elapsed, log = _timed_forward(model, optimizer, device, comm, adapter)
            times[case].append(elapsed)
            logs[case] = log
    local = torch.tensor([min(times[case]) for case in CASES], dtype=torch.float64, device=device)
    tdist.all_reduce(local, op=tdist.ReduceOp.MAX, group=dist.group)
    log = logs["both"]
    return OverlapTimes(*local.tolist(), all_gathers=log.issued, synchronous=log.synchronous)


def _timed_forward(
    model: nn.Module, optimizer: Any, device: torch.device, comm_ms: float, adapter: Any
) -> tuple[float, AllGatherLog]:
    """One iteration; the forward's time in ms (device time on CUDA) and its all-gathers."""
    optimizer.zero_grad()
    x = torch.ones(2, 1, device=device)
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(device)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
    with delayed_all_gathers(comm_ms, device) as log:
        begin = time.perf_counter()
        output = model(x)
        if cuda:
            end.record()
            torch.cuda.synchronize(device)
            elapsed = start.elapsed_time(end)
        else:
            elapsed = (time.perf_counter() - begin) * 1000.0
    adapter.backward(model, output.sum())
    optimizer.step()
    return elapsed, log


def cpu_overlap_failure(times: OverlapTimes, comm_ms: float, label: str) -> str | None:
    """Why the CPU overlap check fails on ``times``, or None when it passes."""
    if times.all_gathers == 0:
        return f"{label}: no all-gather was issued in forward; nothing to overlap"
    ratio = times.cpu_ratio(comm_ms)
    if ratio > MAX_OVERLAP_RATIO:
        serialised = times.all_gathers * comm_ms + (times.compute - times.nothing)
        return (
            f"{label}: no overlap of communication and computation: with prefetch the forward "
            f"took {times.both - times.nothing:.1f} ms over the no-delay case, "
            f"{ratio:.2f}x the serialised {serialised:.1f} ms ({times.all_gathers} all-gathers "
            f"x {comm_ms:g} ms + {times.compute - times.nothing:.1f} ms compute); expected "
            f"<= {MAX_OVERLAP_RATIO}x. {times.describe()}"
        )
    return None


def cuda_overlap_failure(times: OverlapTimes, label: str) -> str | None:
    """Why the CUDA ratio assertions fail on ``times``, or None when they pass."""
    problems = []
    for long_case in ("compute", Op.ALL_GATHER.value):
        long = getattr(times, long_case)
        if not times.nothing * SHORT_TO_LONG < long:
            problems.append(
                f"short case not {SHORT_TO_LONG:g}x faster than {long_case} only "
                f"({times.nothing:.2f} vs {long:.2f} ms): the delays did not take effect"
            )
    if not times.compute + times.all_gather > BOTH_MARGIN * times.both:
        problems.append(
            f"compute + all-gather ({times.compute + times.all_gather:.2f} ms) is not > "
            f"{BOTH_MARGIN:g} x both ({times.both:.2f} ms): no overlap"
        )
    if problems:
        return f"{label}: " + "; ".join(problems) + f". {times.describe()}"
    return None


def check_overlap(adapter: Any, dist: Any, label: str, retries: int = 1) -> OverlapTimes:
    """Measure and check overlap on ``dist.device``, ``retries`` more times on a failure; skips
    without the config's features or (CPU) for synchronous all-gathers."""
    adapter_features.skip_unless(
        adapter, *adapter_features.wrap_features(**overlap_config(dist.device))
    )
    cuda = dist.device.type == "cuda"
    compute_ms, comm_ms = (CUDA_COMPUTE_MS, CUDA_COMM_MS) if cuda else (CPU_COMPUTE_MS, CPU_COMM_MS)
    for attempt in range(retries + 1):
        if cuda and attempt > 0:
            delay._cuda_cycles_per_ms = None  # recalibrate the sleep cycles on a retry
        times = measure_overlap(adapter, dist, compute_ms, comm_ms)
        if not cuda and times.synchronous:
            pytest.skip(
                f"adapter {adapter.name!r} does not support overlap on CPU: it issues its "
                f"all-gathers synchronously (async_op=False; {times.synchronous} of "
                f"{times.all_gathers} per forward), so the CPU thread blocks in every "
                "collective and communication cannot overlap computation"
            )
        if cuda:
            failure = cuda_overlap_failure(times, label)
        else:
            failure = cpu_overlap_failure(times, comm_ms, label)
        if failure is None:
            return times
    failure += f" (failed {retries + 1} measurements)"
    # overlapped / serialised time: about 1 without overlap
    ratio = times.both / (times.compute + times.all_gather) if cuda else times.cpu_ratio(comm_ms)
    raise CheckFailure(failure, "no overlap of communication and computation", ratio=ratio)
