"""What ``fsdp-conformance overlap`` and ``timeline`` run in every rank: the suite's
measurements (``suite.overlap``, ``suite.memory_bound``), written by rank 0 as JSON."""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any

import torch

from fsdp_conformance.adapters import features as adapter_features
from fsdp_conformance.adapters import get_adapter
from fsdp_conformance.cli import usage
from fsdp_conformance.observe.residency import PHASES
from fsdp_conformance.suite import memory_bound, overlap


def overlap_in_rank(dist: Any, out_file: str, limit_all_gathers: bool, repeats: int) -> None:
    """Time the four cases of ``[Note: overlap timing]`` (each the minimum of ``repeats`` runs,
    with the suite's CPU or CUDA delays)."""
    adapter = get_adapter(dist.impl)
    cuda = dist.device.type == "cuda"
    compute_ms = overlap.CUDA_COMPUTE_MS if cuda else overlap.CPU_COMPUTE_MS
    comm_ms = overlap.CUDA_COMM_MS if cuda else overlap.CPU_COMM_MS
    wrap_config = overlap.overlap_config(dist.device, limit_all_gathers)
    adapter_features.skip_unless(adapter, *adapter_features.wrap_features(**wrap_config))
    times = overlap.measure_overlap(
        adapter, dist, compute_ms, comm_ms, repeats, limit_all_gathers=limit_all_gathers
    )
    label = f"adapter {adapter.name!r}"
    if cuda:
        failure = overlap.cuda_overlap_failure(times, label)
        ratio = (times.compute + times.all_gather) / times.both
    else:
        failure = overlap.cpu_overlap_failure(times, comm_ms, label)
        ratio = times.cpu_ratio(comm_ms)
    document = {
        "impl": adapter.name,
        "device": dist.device.type,
        "placement": dist.placement,
        "world_size": dist.world_size,
        "config": {key: str(value) for key, value in wrap_config.items()},
        "compute_ms": compute_ms,
        "comm_ms": comm_ms,
        "repeats": repeats,
        "layers": overlap.LAYERS,
        "times": dataclasses.asdict(times),
        "ratio": ratio,
        "max_ratio": overlap.MAX_OVERLAP_RATIO,
        "failure": failure,
    }
    if dist.rank == 0:
        usage.write_json(out_file, document, indent=1)


def _panel(tracker: Any, case: memory_bound.BoundCase, adapter: Any) -> dict[str, Any]:
    """One panel's data; ``over``: the phases whose peak exceeds the bound (the verdict). The
    bound is the one ``adapter`` is held to: its own (``memory_bound.OWN_BOUNDS``, as the
    memory-bound check does) or the limiter's."""
    samples = tracker.rows()
    own = memory_bound.own_bound_of(adapter, memory_bound.OWN_BOUNDS)
    limiter = "the rate limiter's bound (2 instances, +1 for a prefetch before the reshard)"
    bound_name, bound_of = (own.name, own.bound) if own is not None else (limiter, case.bound)
    bound = {phase: bound_of(phase) for phase in PHASES}
    peaks = [
        {
            "iteration": iteration,
            "phase": phase,
            "resident": peak.resident,
            "bound": bound[phase],
            "at_instance": peak.at_instance,
        }
        for (iteration, phase), peak in tracker.peaks.items()
        if phase in PHASES
    ]
    return {
        "limit_all_gathers": case.limit_all_gathers,
        "config": case.describe(),
        "bound_name": bound_name,
        "bound": bound,
        "max_resident": max((sample["resident"] for sample in samples), default=0),
        "peaks": peaks,
        "over": [peak for peak in peaks if peak["resident"] > peak["bound"]],
        "samples": samples,
    }


def timeline_in_rank(
    dist: Any,
    out_file: str,
    lag: str,
    iterations: int,
    layers: int,
    backward_prefetch: str | None,
    forward_prefetch: bool,
    trace_file: str | None = None,
) -> None:
    """Residency time series with ``limit_all_gathers`` True and False; with ``trace_file``,
    rank 0 exports a Chrome trace of the limited run (``torch.profiler``)."""
    adapter = get_adapter(dist.impl)
    panels = []
    for limit in (True, False):
        case = memory_bound.BoundCase(lag, "FULL_SHARD", backward_prefetch, forward_prefetch, limit)
        profile = limit and trace_file is not None and dist.rank == 0
        cpu = [torch.profiler.ProfilerActivity.CPU]
        profiler = torch.profiler.profile(activities=cpu) if profile else contextlib.nullcontext()
        with profiler:
            tracker = memory_bound.measure_residency(
                adapter, dist.group, case.wrap_config, lag, iterations, layers
            )
        if profile:
            profiler.export_chrome_trace(trace_file)
        panels.append(_panel(tracker, case, adapter))
    document = {
        "impl": adapter.name,
        "lag": lag,
        "layers": layers,
        "iterations": iterations,
        "world_size": dist.world_size,
        "panels": panels,
    }
    if dist.rank == 0:
        usage.write_json(out_file, document, indent=1)
