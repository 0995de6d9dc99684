"""Measuring the two-instance memory bound of ``limit_all_gathers`` (``measure_residency``,
``check_residency``); the check is ``BaseMemoryBoundTests`` in test_memory_bound.py.

[Note: memory bound]
*Resident* unsharded buffers are counted as ``fsdp_conformance.observe.residency`` says (from
all-gather issue until the free has completed on the device). On CPU the device is the
``LaggingDevice`` (``strict``: never catches up by itself; ``drained``: catches up at the end of
every iteration), so the only thing that frees memory is the CPU blocking on a free event -- what
the rate limiter does. Bound per phase, from the config (FULL_SHARD, ``limit_all_gathers=True``):

    bound(phase) = MAX_INFLIGHT (2: the instance computing + the one being gathered)
                   + 1 if the phase has an *early* prefetch, i.e. one issued before the current
                       instance's reshard: forward_prefetch in forward, BACKWARD_PRE in backward

A phase's peak is the most non-root buffers resident right after one of its all-gathers; every
iteration and phase of ``ITERATIONS`` is checked (forward prefetch uses the order recorded in the
previous iteration, so iteration 1 never prefetches in forward). With ``limit_all_gathers=False``
the CPU never waits and the peak grows with depth: the check must fail there, which proves it can.

SHARD_GRAD_OP keeps every buffer from forward to backward by design (no reshard after forward),
so the limiter has nothing to bound in forward: the check exempts the forward phase and holds the
backward phase to its bound (an implementation that frees after forward and re-gathers in
backward is held to the bound there). See docs/memory_bound.md for the measured tables and the
torch FSDP1 deviation.

An adapter declares the cases its implementation exceeds the bound on as a known deviation
(``Deviation("memory_bound", reason, applies=lambda case: ...)``, the case a ``BoundCase``):
such cases are strict expected failures (suite/verdict.py); a suite subclass setting
``known_deviations`` gets a TypeError naming the fix.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import gc
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

from fsdp_conformance import constants
from fsdp_conformance.adapters import Adapter, Feature
from fsdp_conformance.adapters import deviations as adapter_deviations
from fsdp_conformance.adapters import features as adapter_features
from fsdp_conformance.adapters import loop as adapter_loop
from fsdp_conformance.observe.lagging import LAG_VARIANTS, LaggingDevice
from fsdp_conformance.observe.residency import PHASES, ResidencyTracker
from fsdp_conformance.suite.stream_bound import FSDP2_BOUND, StreamOrderedBound

# Buffers the limiter allows: the instance computing now and the one whose all-gather is in
# flight (torch FSDP1's `_max_num_inflight_all_gathers`, "empirically chosen")
MAX_INFLIGHT = constants.MAX_INFLIGHT
# Iterations per run: forward prefetch starts in iteration 2; 3 shows the steady state
ITERATIONS = 3
# Non-root FSDP instances in the model (the bound is only interesting with >= 4)
LAYERS = 6
# Width of each instance's Linear (its unsharded buffer holds WIDTH * WIDTH + WIDTH elements)
WIDTH = 16
# CUDA variant: 1024-wide Linears (4 MiB of fp32 parameters per instance), a 2 ms device-side
# delay before each layer's forward, each free and each reduction; slack for activations,
# shards and allocator rounding (half an instance)
CUDA_WIDTH = 1024
CUDA_DELAY_MS = 2.0
CUDA_SLACK_BYTES = (CUDA_WIDTH * CUDA_WIDTH + CUDA_WIDTH) * 4 // 2


class ChainOfLinears(nn.Module):
    """A root Linear followed by ``layers`` wrapped Linear instances, each (B, width) -> (B, width).

    Args:
        wrap: wraps each of the ``layers`` Linears (None: unwrapped).
        layers: number of wrapped instances.
        width: feature width.
        device: where the parameters live before wrapping (None: CPU).
    """

    def __init__(
        self,
        wrap: Callable[..., nn.Module] | None,
        layers: int = LAYERS,
        width: int = WIDTH,
        device: torch.device | None = None,
    ):
        super().__init__()
        generator = torch.Generator().manual_seed(0)
        linears = [nn.Linear(width, width) for _ in range(layers + 1)]
        with torch.no_grad():
            for linear in linears:  # the same init on every rank, without the global RNG
                linear.weight.copy_(torch.randn(linear.weight.shape, generator=generator) / width)
                linear.bias.zero_()
                linear.to(device)  # before wrapping (None: stay on CPU)
        self.width = width
        self.root_linear = linears[0]  # (B, width) -> (B, width), owned by the root instance
        self.layers = nn.Sequential(*(wrap(linear) if wrap else linear for linear in linears[1:]))
        # the wrapped Linears themselves (a tuple: not registered twice as submodules)
        self.inner_linears = tuple(linears[1:])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(torch.relu(self.root_linear(x)))

    def get_input(self, device: torch.device, rank: int = 0) -> torch.Tensor:
        return torch.rand(4, self.width, generator=torch.Generator().manual_seed(1 + rank)).to(
            device
        )


@dataclasses.dataclass(frozen=True)
class BoundCase:
    """One configuration of the memory-bound check (picklable: it travels to the ranks)."""

    # "strict" or "drained" (see fsdp_conformance.observe.lagging); "cuda" for the CUDA variant
    lag: str
    # "FULL_SHARD" or "SHARD_GRAD_OP"
    sharding_strategy: str = "FULL_SHARD"
    # None, "BACKWARD_PRE" or "BACKWARD_POST"
    backward_prefetch: str | None = None
    forward_prefetch: bool = False
    limit_all_gathers: bool = True

    @property
    def wrap_config(self) -> dict[str, Any]:
        return {
            "sharding_strategy": self.sharding_strategy,
            "backward_prefetch": self.backward_prefetch,
            "forward_prefetch": self.forward_prefetch,
            "limit_all_gathers": self.limit_all_gathers,
        }

    @property
    def id(self) -> str:
        return (
            f"{self.lag}-{self.sharding_strategy}-bwd={self.backward_prefetch}-"
            f"fwd={int(self.forward_prefetch)}-limit={int(self.limit_all_gathers)}"
        )

    def describe(self) -> str:
        config = ", ".join(f"{key}={value!r}" for key, value in self.wrap_config.items())
        if self.lag == "cuda":
            return f"{config}, CUDA with device-side delays"
        return f"{config}, {self.lag} lagging device"

    def early_prefetch(self, phase: str) -> bool:
        """Whether ``phase`` issues a prefetch before the current instance's reshard."""
        if phase == "forward":
            return self.forward_prefetch
        return self.backward_prefetch == "BACKWARD_PRE"

    def bound(self, phase: str) -> int:
        """The most non-root buffers allowed resident in ``phase`` (see [Note: memory bound])."""
        return MAX_INFLIGHT + (1 if self.early_prefetch(phase) else 0)

    def checked_phases(self) -> tuple[str, ...]:
        """The phases the bound applies to (SHARD_GRAD_OP keeps buffers through forward)."""
        return ("backward",) if self.sharding_strategy == "SHARD_GRAD_OP" else PHASES

    def param(self, marks: Any = ()) -> Any:
        return pytest.param(self, id=self.id, marks=[pytest.mark.world_size(2), *marks])


# ---------------------------------------------------------------------------- measuring
def measure_residency(
    adapter: Adapter,
    group: Any,
    config: dict[str, Any],
    lag: str = "strict",
    iterations: int = ITERATIONS,
    layers: int = LAYERS,
) -> ResidencyTracker:
    """Train a ``ChainOfLinears`` under a lagging device and return the residency tracker.

    Skips (``adapter.require``) when the adapter cannot limit all-gathers, install a device
    handle, trace communication, or run ``config``.

    Args:
        adapter: the FSDP under test.
        group: the process group to shard over.
        config: the wrap config (adapter vocabulary).
        lag: the lagging-device variant.
        iterations: training iterations; each is split into the tracker's "forward",
            "backward" and "step" phases.
        layers: non-root instances.
    """
    adapter_features.skip_unless(adapter, Feature.LIMIT_ALL_GATHERS)
    adapter_features.skip_unless(adapter, Feature.DEVICE_HANDLE, Feature.COMM_TRACE)
    adapter_features.skip_unless(adapter, *adapter_features.wrap_features(adapter, **config))
    wrap = adapter.wrapper(**config)
    chain = ChainOfLinears(lambda module: wrap(module, process_group=group), layers)
    model = adapter.wrap(chain, process_group=group, root=True, **config)
    device = LaggingDevice(lag)
    adapter.install_device_handle(model, device)
    tracker = ResidencyTracker(device, adapter.instances(model))
    optimizer = adapter_loop.optimizer(adapter, model, "sgd", lr=0.01, momentum=0.9)
    x = chain.get_input(torch.device("cpu"), group.rank())
    # Buffers observed by their lifetime (torch FSDP2) must not die at a garbage collection of
    # an earlier model's cycles halfway through a phase: collect now, none while measuring
    # (a buffer held by a reference cycle then stays resident, the conservative reading)
    gc.collect()
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        with adapter.observe(tracker):
            for iteration in range(1, iterations + 1):
                tracker.start(iteration, "forward")
                loss = model(x).sum()
                tracker.start(iteration, "backward")
                adapter_loop.backward(adapter, model, loss)
                tracker.start(iteration, "step")
                optimizer.step()
                optimizer.zero_grad()
                device.end_iteration()  # drained: the device catches up, as loss.item() forces
    finally:
        if gc_was_enabled:
            gc.enable()
        tracker.close()
    return tracker


@dataclasses.dataclass
class CudaForwardPeaks:
    """Allocator statistics of ``measure_cuda_forward_peaks``."""

    # bytes of one non-root instance's unsharded parameters (all are the same size)
    instance_bytes: int
    # bytes of the root's unsharded parameters
    root_bytes: int
    # per iteration: peak active bytes during forward, above what was active before it
    forward_peaks: list[int]


def measure_cuda_forward_peaks(
    adapter: Adapter,
    group: Any,
    device: torch.device,
    config: dict[str, Any],
    delay_ms: float = CUDA_DELAY_MS,
    iterations: int = ITERATIONS,
    layers: int = LAYERS,
    width: int = CUDA_WIDTH,
) -> CudaForwardPeaks:
    """Train a ``ChainOfLinears`` on CUDA with device-side delays; peak active bytes per forward.

    The device is slowed with ``torch.cuda._sleep`` (``fsdp_conformance.models.sleep_ms``) before
    each layer's forward compute, before each free of unsharded parameters (the MoE model's
    ``delay_before_free``) and before each gradient reduction (ModuleWithDelay's delayed
    reduce-scatter), so the CPU runs ahead and only the rate limiter holds it back. "Active"
    bytes (``active_bytes.all.peak``) count blocks still in use by a stream after their free
    (``record_stream``), i.e. residency as ``[Note: residency]`` in ``observe/residency.py``
    defines it.
    """
    from fsdp_conformance.models import cycles_per_ms, sleep_ms

    cycles_per_ms(device)  # calibrate now: calibration synchronizes, which would drain the device

    adapter_features.skip_unless(adapter, Feature.LIMIT_ALL_GATHERS)
    adapter_features.skip_unless(adapter, Feature.COMM_TRACE)
    adapter_features.skip_unless(adapter, *adapter_features.wrap_features(adapter, **config))
    wrap = adapter.wrapper(**config)
    chain = ChainOfLinears(
        lambda module: wrap(module, process_group=group), layers, width, device=device
    )
    model = adapter.wrap(chain, process_group=group, root=True, **config)
    delay = functools.partial(sleep_ms, delay_ms, device)
    for linear in chain.inner_linears:  # after the unshard, before the compute
        linear.register_forward_pre_hook(lambda module, args: delay())
    instances = adapter.instances(model)
    element_bytes = chain.root_linear.weight.element_size()
    instance_bytes = (width * width + width) * element_bytes
    optimizer = adapter_loop.optimizer(adapter, model, "sgd", lr=0.01)
    x = chain.get_input(device, group.rank())
    peaks = []
    with contextlib.ExitStack() as hooks:
        for instance in instances[1:]:
            hooks.enter_context(adapter_loop.delay_before_free(adapter, instance, delay))
        hooks.enter_context(adapter_loop.delay_before_reduction(adapter, delay))
        for _ in range(iterations):
            torch.cuda.synchronize(device)
            before = torch.cuda.memory_stats(device)["active_bytes.all.current"]
            torch.cuda.reset_peak_memory_stats(device)
            loss = model(x).sum()
            torch.cuda.synchronize(device)
            peaks.append(torch.cuda.memory_stats(device)["active_bytes.all.peak"] - before)
            adapter_loop.backward(adapter, model, loss)
            optimizer.step()
            optimizer.zero_grad()
    return CudaForwardPeaks(instance_bytes, instance_bytes, peaks)


def check_cuda_forward_peaks(measured: CudaForwardPeaks, case: BoundCase, label: str) -> None:
    """Assert every forward's peak active bytes <= root + bound x instance + slack."""
    bound = case.bound("forward")
    allowed = measured.root_bytes + bound * measured.instance_bytes + CUDA_SLACK_BYTES
    over = [
        f"iteration {iteration} forward: peak active {peak} bytes > {allowed} (root "
        f"{measured.root_bytes} + {bound} x instance {measured.instance_bytes} + slack "
        f"{CUDA_SLACK_BYTES})"
        for iteration, peak in enumerate(measured.forward_peaks, start=1)
        if peak > allowed
    ]
    if over:
        raise AssertionError(
            f"memory bound exceeded (CUDA allocator): {over[0]}\n  {label}, {case.describe()}"
            + "".join(f"\n  {line}" for line in over)
        )


def check_residency(
    tracker: ResidencyTracker,
    case: BoundCase,
    label: str,
    own_bound: StreamOrderedBound | None = None,
) -> None:
    """Assert every checked iteration and phase stays within the case's bound.

    Args:
        tracker: the measured residency.
        case: the configuration (gives the limiter's bound).
        label: names the adapter in the message.
        own_bound: the implementation's own bound (``OWN_BOUNDS``), used instead of the
            limiter's ``case.bound`` when given.

    Raises:
        AssertionError: naming the config, and for each violation the iteration, phase, peak,
            bound and the instance whose all-gather reached the peak.
    """
    iterations = sorted({iteration for iteration, _ in tracker.peaks if iteration > 0})
    violations = []
    first_at = -1  # sample index of the first violation's peak
    for iteration in iterations:
        for phase in case.checked_phases():
            peak = tracker.peak(iteration, phase)
            bound = case.bound(phase) if own_bound is None else own_bound.bound(phase)
            if peak.resident > bound:
                first_at = peak.at_index if not violations else first_at
                early = " incl. +1 for the early prefetch" if case.early_prefetch(phase) else ""
                if own_bound is not None:
                    early = f" ({own_bound.explain(phase)})"
                violations.append(
                    f"iteration {iteration} {phase}: peak {peak.resident} resident non-root "
                    f"unsharded buffers exceeds the bound {bound}{early} (reached at the "
                    f"all-gather of instance {peak.at_instance})"
                )
    if violations:
        table = tracker.peak_table().replace("\n", "; ")
        lead_up = ""
        if own_bound is not None:  # which buffers were resident: the events up to the first peak
            events = tracker.samples[max(0, first_at - 8) : first_at + 1]
            lead_up = "\n  events before the peak: " + "; ".join(
                f"{sample.op} {sample.instance} -> {sample.resident}" for sample in events
            )
        raise AssertionError(
            f"memory bound exceeded: {violations[0]}\n  {label}, {case.describe()}\n  "
            + "\n  ".join(violations)
            + f"\n  peaks per iteration and phase: {table}"
            + lead_up
        )


def check_shard_grad_op_forward(
    tracker: ResidencyTracker,
    case: BoundCase,
    label: str,
    own_bound: StreamOrderedBound | None = None,
    layers: int = LAYERS,
) -> None:
    """SHARD_GRAD_OP's first forward keeps every instance's unsharded parameters, and no more.

    A promise with two sides, checked as two bounds (never as one exact count of a release):

    - at least ``layers`` resident: each instance is all-gathered once and kept until backward
      (no reshard after forward). This lower bound is also what makes the backward bound worth
      something: it proves the tracker sees the buffers the strategy keeps;
    - at most ``layers`` + the all-gather outputs an implementation may hold in flight
      (``own_bound.shard_grad_op_forward(layers)``: + 2 for torch FSDP2, whose releases differ in how long the
      previous output is kept -- 2 up to 2.14, 1 from 2.15; 0 for a limiter that gathers into
      the unsharded buffer itself).

    Raises:
        AssertionError: "SHARD_GRAD_OP forward keeps too few" / "holds more than" messages,
            naming the config, the peak and the bound.
    """
    peak = tracker.peak(1, "forward").resident
    # the own bound's SHARD_GRAD_OP forward figure is its upper end (layers + outputs in flight)
    most = layers if own_bound is None else own_bound.shard_grad_op_forward(layers)
    in_flight = most - layers
    where = f"{label}, {case.describe()}"
    if peak < layers:
        raise AssertionError(
            f"SHARD_GRAD_OP forward keeps too few buffers: iteration 1 forward should all-gather "
            f"all {layers} instances and keep them (no reshard after forward), peak "
            f"{peak} < {layers} resident non-root unsharded buffers\n  {where}"
        )
    if peak > most:
        raise AssertionError(
            f"SHARD_GRAD_OP forward holds more than it keeps: iteration 1 forward peak {peak} "
            f"resident non-root buffers > {most} ({layers} kept unsharded + {in_flight} "
            f"all-gather outputs in flight)\n  {where}"
        )


# Adapter name -> the implementation's own bound, where it bounds memory by design rather than
# with a rate limiter (limit_all_gathers=True then means "hold it to its own bound"). Looked up
# by the adapter's name, then by the names of the adapter classes it derives from and of the
# adapters it delegates to, so a wrapper of torch-fsdp2 keeps FSDP2's bound.
OWN_BOUNDS: dict[str, StreamOrderedBound] = {"torch-fsdp2": FSDP2_BOUND}


# - DeepSpeed ZeRO-3 (0.19.8) bounds memory with fetch back-pressure, not a limiter
@dataclasses.dataclass(frozen=True)
class FetchBackpressureBound:
    """DeepSpeed ZeRO-3's own bound under the lagging device (docs/deepspeed.md).

    On a device with events DeepSpeed records one after each parameter fetch and, past
    ``max_ongoing_fetch_events`` (2) outstanding, blocks the CPU on the oldest: the CPU waits for
    the fetch ``max_ongoing_fetch_events + 1`` parameter fetches back, so the frees of the last
    ``draining`` two-parameter instances may still be in flight when the next is gathered
    (ceil(3 / 2) = 2); gradient reductions do the same in backward (``max_param_reduce_events``).
    Prefetch is limited by ``stage3_max_live_parameters`` (what ``limit_all_gathers=True`` maps
    to: ``LIVE_INSTANCES`` instances' elements), so a prefetched instance is one of those.
    """

    draining: int = 2  # instances whose free may not have completed
    gathering: int = 1  # the instance being gathered
    # all-gather outputs held besides the unsharded parameters: none (ZeRO-3 gathers into the
    # parameter itself)
    forward_outputs: int = 0
    name: str = "DeepSpeed's fetch back-pressure bound"

    def bound(self, phase: str) -> int:
        return self.draining + self.gathering

    def explain(self, phase: str) -> str:
        return f"{self.name}: {self.draining} draining + {self.gathering} gathering"

    def shard_grad_op_forward(self, layers: int) -> int:
        return layers


OWN_BOUNDS["deepspeed"] = FetchBackpressureBound()  # type: ignore[assignment]


def own_bound_of(
    adapter: Adapter, bounds: dict[str, StreamOrderedBound]
) -> StreamOrderedBound | None:
    """The implementation's own bound for ``adapter`` from ``bounds`` (None: the limiter's)."""
    for member in adapter_deviations.delegation_chain(adapter):
        names = [member.name] + [cls.__dict__.get("name") for cls in type(member).__mro__]
        for name in names:
            if isinstance(name, str) and name in bounds:
                return bounds[name]
    return None


def limited_cases(lag_variants: tuple[str, ...] = LAG_VARIANTS) -> list[BoundCase]:
    """FULL_SHARD, limit on: every prefetch setting under each lag variant."""
    return [
        BoundCase(lag, "FULL_SHARD", backward, forward)
        for lag in lag_variants
        for backward in (None, "BACKWARD_PRE", "BACKWARD_POST")
        for forward in (False, True)
    ]
