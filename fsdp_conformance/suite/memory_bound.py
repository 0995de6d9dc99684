"""Measuring the two-instance memory bound of ``limit_all_gathers``; the check is
``BaseMemoryBoundTests`` (test_memory_bound.py).

[Note: memory bound]
On CPU the device is a ``LaggingDevice``: only the CPU blocking on a free event (the rate
limiter) frees memory. Resident non-root buffers per phase (FULL_SHARD, limit on) are bounded by
``MAX_INFLIGHT`` (the instance computing + the one gathered) + 1 for an early prefetch
(forward_prefetch in forward, BACKWARD_PRE in backward); without the limiter the check must
fail. SHARD_GRAD_OP keeps every buffer through forward: only backward is bounded.
docs/memory_bound.md has the long form and the measured tables."""

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
from fsdp_conformance.adapters.base import delay_before_free, delay_before_reduction
from fsdp_conformance.checks import CheckFailure
from fsdp_conformance.observe.lagging import LAG_VARIANTS, LaggingDevice
from fsdp_conformance.observe.residency import PHASES, ResidencyTracker
from fsdp_conformance.suite.stream_bound import FSDP2_BOUND, StreamOrderedBound

MAX_INFLIGHT = constants.MAX_INFLIGHT
# forward prefetch starts in iteration 2; 3 shows the steady state
ITERATIONS = 3
# non-root instances (the bound is only interesting with >= 4)
LAYERS = 6
WIDTH = 16
# CUDA variant: 4 MiB per instance; slack (half an instance) for activations and rounding
CUDA_WIDTH = 1024
CUDA_DELAY_MS = 2.0
CUDA_SLACK_BYTES = (CUDA_WIDTH * CUDA_WIDTH + CUDA_WIDTH) * 4 // 2


class ChainOfLinears(nn.Module):
    """A root Linear followed by ``layers`` Linears, each wrapped by ``wrap`` (None: not)."""

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
                linear.to(device)
        self.width = width
        self.root_linear = linears[0]
        self.layers = nn.Sequential(*(wrap(linear) if wrap else linear for linear in linears[1:]))
        # a tuple: not registered twice as submodules
        self.inner_linears = tuple(linears[1:])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(torch.relu(self.root_linear(x)))

    def get_input(self, device: torch.device, rank: int = 0) -> torch.Tensor:
        generator = torch.Generator().manual_seed(1 + rank)
        return torch.rand(4, self.width, generator=generator).to(device)


@dataclasses.dataclass(frozen=True)
class BoundCase:
    """One configuration of the memory-bound check (picklable: it travels to the ranks)."""

    lag: str  # a LAG_VARIANTS entry, or "cuda" for the CUDA variant
    sharding_strategy: str = "FULL_SHARD"
    backward_prefetch: str | None = None
    forward_prefetch: bool = False
    limit_all_gathers: bool = True

    @property
    def wrap_config(self) -> dict[str, Any]:
        return {key: value for key, value in dataclasses.asdict(self).items() if key != "lag"}

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
        return MAX_INFLIGHT + (1 if self.early_prefetch(phase) else 0)

    def checked_phases(self) -> tuple[str, ...]:
        return ("backward",) if self.sharding_strategy == "SHARD_GRAD_OP" else PHASES

    def param(self) -> Any:
        return pytest.param(self, id=self.id, marks=pytest.mark.world_size(2))


def _chain_model(
    adapter: Adapter, group: Any, config: dict[str, Any], *chain_args: Any, **chain_kwargs: Any
) -> tuple[ChainOfLinears, nn.Module]:
    """A ``ChainOfLinears`` with every Linear wrapped by ``adapter`` with ``config``, and its
    wrapped root; skips unless the adapter supports the config."""
    adapter_features.skip_unless(adapter, *adapter_features.wrap_features(**config))
    wrap = adapter.wrapper(**config)
    chain = ChainOfLinears(
        lambda module: wrap(module, process_group=group), *chain_args, **chain_kwargs
    )
    return chain, adapter.wrap(chain, process_group=group, root=True, **config)


def measure_residency(
    adapter: Adapter,
    group: Any,
    config: dict[str, Any],
    lag: str = "strict",
    iterations: int = ITERATIONS,
    layers: int = LAYERS,
) -> ResidencyTracker:
    """Train a ``ChainOfLinears`` wrapped with ``config`` under a ``LaggingDevice(lag)``; returns
    the residency tracker. Skips without limit_all_gathers, device_handle, comm_trace or the
    config's features."""
    adapter_features.skip_unless(adapter, Feature.LIMIT_ALL_GATHERS)
    adapter_features.skip_unless(adapter, Feature.DEVICE_HANDLE, Feature.COMM_TRACE)
    chain, model = _chain_model(adapter, group, config, layers)
    device = LaggingDevice(lag)
    adapter.install_device_handle(model, device)
    tracker = ResidencyTracker(device, adapter.instances(model))
    optimizer = adapter.optimizer(model, "sgd", lr=0.01, momentum=0.9)
    x = chain.get_input(torch.device("cpu"), group.rank())
    # buffers observed by their lifetime (torch FSDP2) must not die at a collection mid-phase
    gc.collect()
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        with adapter.observe(tracker):
            for iteration in range(1, iterations + 1):
                tracker.start(iteration, "forward")
                loss = model(x).sum()
                tracker.start(iteration, "backward")
                adapter.backward(model, loss)
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
    """Allocator statistics of ``measure_cuda_forward_peaks`` (bytes)."""

    instance_bytes: int  # one non-root instance's unsharded parameters
    root_bytes: int
    forward_peaks: list[int]  # per iteration: peak active bytes above those active before


def measure_cuda_forward_peaks(
    adapter: Adapter, group: Any, device: torch.device, config: dict[str, Any]
) -> CudaForwardPeaks:
    """Train a ``ChainOfLinears`` on CUDA with device-side delays (before each layer's compute,
    free and gradient reduction, so only the rate limiter holds the CPU back); the peak active
    bytes of each forward (active blocks include those a stream still uses after their free)."""
    from fsdp_conformance.models import cycles_per_ms, sleep_ms

    cycles_per_ms(device)  # calibrate now: calibration synchronizes, which would drain the device

    adapter_features.skip_unless(adapter, Feature.LIMIT_ALL_GATHERS)
    adapter_features.skip_unless(adapter, Feature.COMM_TRACE)
    chain, model = _chain_model(adapter, group, config, LAYERS, CUDA_WIDTH, device=device)
    delay = functools.partial(sleep_ms, CUDA_DELAY_MS, device)
    for linear in chain.inner_linears:  # after the unshard, before the compute
        linear.register_forward_pre_hook(lambda module, args: delay())
    instance_bytes = (
        CUDA_WIDTH * CUDA_WIDTH + CUDA_WIDTH
    ) * chain.root_linear.weight.element_size()
    optimizer = adapter.optimizer(model, "sgd", lr=0.01)
    x = chain.get_input(device, group.rank())
    peaks = []
    with contextlib.ExitStack() as hooks:
        for instance in adapter.instances(model)[1:]:
            hooks.enter_context(delay_before_free(adapter, instance, delay))
        hooks.enter_context(delay_before_reduction(adapter, delay))
        for _ in range(ITERATIONS):
            torch.cuda.synchronize(device)
            before = torch.cuda.memory_stats(device)["active_bytes.all.current"]
            torch.cuda.reset_peak_memory_stats(device)
            loss = model(x).sum()
            torch.cuda.synchronize(device)
            peaks.append(torch.cuda.memory_stats(device)["active_bytes.all.peak"] - before)
            adapter.backward(model, loss)
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
    """Assert every checked iteration and phase stays within ``case.bound`` (or ``own_bound``,
    the implementation's own); the AssertionError names each violation's peak, bound and the
    instance whose all-gather reached it."""
    iterations = sorted({iteration for iteration, _ in tracker.peaks if iteration > 0})
    violations = []
    first_at = -1  # sample index of the first violation's peak
    worst: dict[str, int] = {}  # the figure: peak per checked phase over the iterations
    for iteration in iterations:
        for phase in case.checked_phases():
            peak = tracker.peak(iteration, phase)
            worst[f"peak_{phase}"] = max(worst.get(f"peak_{phase}", 0), peak.resident)
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
        raise CheckFailure(
            f"memory bound exceeded: {violations[0]}\n  {label}, {case.describe()}\n  "
            + "\n  ".join(violations)
            + f"\n  peaks per iteration and phase: {table}"
            + lead_up,
            "memory bound exceeded",
            **worst,
        )


def check_shard_grad_op_forward(
    tracker: ResidencyTracker,
    case: BoundCase,
    label: str,
    own_bound: StreamOrderedBound | None = None,
) -> None:
    """SHARD_GRAD_OP's first forward keeps every instance's unsharded parameters (at least
    ``LAYERS`` resident: this also proves the tracker sees them), and no more than ``LAYERS`` +
    the all-gather outputs the implementation may hold in flight."""
    peak = tracker.peak(1, "forward").resident
    most = LAYERS if own_bound is None else own_bound.shard_grad_op_forward(LAYERS)
    where = f"{label}, {case.describe()}"
    if peak < LAYERS:
        raise CheckFailure(
            f"SHARD_GRAD_OP forward keeps too few buffers: iteration 1 forward should all-gather "
            f"all {LAYERS} instances and keep them (no reshard after forward), peak "
            f"{peak} < {LAYERS} resident non-root unsharded buffers\n  {where}",
            "SHARD_GRAD_OP forward keeps too few buffers",
            missing=LAYERS - peak,
        )
    if peak > most:
        raise CheckFailure(
            f"SHARD_GRAD_OP forward holds more than it keeps: iteration 1 forward peak {peak} "
            f"resident non-root buffers > {most} ({LAYERS} kept unsharded + {most - LAYERS} "
            f"all-gather outputs in flight)\n  {where}",
            "SHARD_GRAD_OP forward holds more than it keeps",
            peak_forward=peak,
        )


@dataclasses.dataclass(frozen=True)
class FetchBackpressureBound(StreamOrderedBound):
    """DeepSpeed ZeRO-3's own bound (docs/deepspeed.md): past 2 outstanding fetches the CPU blocks
    on the oldest, so the frees of ``draining`` instances may be in flight while one is gathered;
    it gathers into the parameters themselves (no all-gather outputs)."""

    forward_outputs: int = 0
    name: str = "DeepSpeed's fetch back-pressure bound"
    draining: int = 2
    gathering: int = 1

    def bound(self, phase: str) -> int:
        return self.draining + self.gathering

    def explain(self, phase: str) -> str:
        return f"{self.name}: {self.draining} draining + {self.gathering} gathering"


# adapter name -> the implementation's own bound, where it bounds memory without a rate limiter
OWN_BOUNDS: dict[str, StreamOrderedBound] = {
    "torch-fsdp2": FSDP2_BOUND,
    "deepspeed": FetchBackpressureBound(),
}


def own_bound_of(
    adapter: Adapter, bounds: dict[str, StreamOrderedBound]
) -> StreamOrderedBound | None:
    """The own bound of ``adapter`` in ``bounds`` (None: the limiter's), looked up by its name,
    the names of its adapter classes and of the adapters it delegates to."""
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
