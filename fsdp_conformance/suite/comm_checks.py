"""Communication checks on a ``CommTrace`` ([Note: comm trace]) of ``ITERATIONS`` training
iterations, phases ``iteration i forward`` and ``iteration i backward``.

[Note: prefetch happens]
A prefetched all-gather is issued by another instance's hook before the target's own (torch
issue #106030: prefetch that silently did nothing). For consecutive instances I, J gathering in
the phase: ``forward_prefetch`` (iterations >= 2), in compute order: J's all-gather before I's
compute; ``BACKWARD_PRE``, in reverse order of the forward's frees: J's all-gather before I's
free and gradient reduction; ``BACKWARD_POST``: before I's gradient reduction.

[Note: counts as bounds]
The counts bound what the configuration promises, not one call per instance. Per iteration,
with an instance's forward all-gathers as its uses: in forward every instance all-gathers and
nothing is reduced; in backward SHARD_GRAD_OP gathers nothing and FULL_SHARD no more than the
uses; outside no_sync every instance is reduced at most once per use (once without uses),
inside none."""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from torch import nn

from fsdp_conformance.adapters import Feature
from fsdp_conformance.adapters import features as adapter_features
from fsdp_conformance.checks import CheckFailure
from fsdp_conformance.constants import REDUCE_OPS, Op
from fsdp_conformance.observe.comm_trace import CommEvent, CommTrace

from . import training

# forward prefetch starts in iteration 2 (it uses iteration 1's order); 3 is the steady state
ITERATIONS = 3


def trace_training(
    adapter: Any,
    model_name: str,
    dist: Any,
    config: dict[str, Any],
    compute: bool = True,
    inside_no_sync: Callable[[int], bool] | None = None,
) -> tuple[CommTrace, nn.Module]:
    """Train the zoo model ``model_name`` wrapped with ``config`` (``iterate``), tracing every
    phase; returns the trace and the root."""
    adapter_features.skip_unless(adapter, Feature.COMM_TRACE)
    driver = training.fsdp_driver(adapter, model_name, dist, config)
    trace = CommTrace(adapter, driver.model, compute=compute)
    iterate(driver, trace, inside_no_sync)
    return trace, driver.model


def iterate(
    driver: training.Driver,
    trace: CommTrace | None = None,
    inside_no_sync: Callable[[int], bool] | None = None,
) -> None:
    """``ITERATIONS`` iterations on the zoo model's input, in phases ``iteration i forward`` and
    ``iteration i backward`` of ``trace`` (the optimizer made before). Iterations for which
    ``inside_no_sync`` is true run inside ``no_sync`` and accumulate into the next (no
    optimizer step)."""
    zoo_model, optimizer = driver.zoo_model, driver.optimizer
    phase = trace.phase if trace is not None else lambda name: contextlib.nullcontext()
    with trace or contextlib.nullcontext():
        for iteration in range(1, ITERATIONS + 1):
            no_sync = inside_no_sync is not None and inside_no_sync(iteration)
            with driver.no_sync() if no_sync else contextlib.nullcontext():
                inputs = zoo_model.get_input(driver.device)
                with phase(f"iteration {iteration} forward"):
                    loss = zoo_model.get_loss(inputs, driver.model(*inputs))
                with phase(f"iteration {iteration} backward"):
                    driver.backward(loss)
            if not no_sync:  # gradients of no_sync iterations accumulate into the next one
                optimizer.step()
                optimizer.zero_grad()


def _first(events: list[CommEvent], op: str | tuple[str, ...], label: str) -> int | None:
    ops = (op,) if isinstance(op, str) else op
    return next((i for i, e in enumerate(events) if e.op in ops and e.label == label), None)


def _order(events: list[CommEvent], op: str) -> list[str]:
    return list(dict.fromkeys(event.label for event in events if event.op == op))


def _iteration_phases(trace: CommTrace) -> Iterator[tuple[str, int, str]]:
    """(phase, iteration, "forward" / "backward") of each iteration phase of ``trace``."""
    for phase in trace.phases:
        if phase.startswith("iteration "):
            _, iteration, kind = phase.split(" ")
            yield phase, int(iteration), kind


def prefetch_failures(trace: CommTrace, config: dict[str, Any]) -> list[str]:
    """Each way the trace shows a configured prefetch not happening ([Note: prefetch happens])."""
    failures = []
    forward_prefetch = bool(config.get("forward_prefetch"))
    backward_prefetch = config.get("backward_prefetch")
    for phase, iteration, kind in _iteration_phases(trace):
        events = trace.select(phase)
        gathering = set(_order(events, Op.ALL_GATHER))
        if kind == "forward" and forward_prefetch and iteration >= 2:
            order = [label for label in _order(events, Op.COMPUTE) if label in gathering]
            for current, following in itertools.pairwise(order):
                if _first(events, Op.ALL_GATHER, following) > _first(events, Op.COMPUTE, current):
                    failures.append(
                        f"{phase}: forward_prefetch did not prefetch: the all-gather of "
                        f"{following!r} was issued after {current!r} started its forward "
                        "compute (expected before)"
                    )
        if kind == "backward" and backward_prefetch in ("BACKWARD_PRE", "BACKWARD_POST"):
            post_forward_order = _order(trace.select(f"iteration {iteration} forward"), Op.FREE)
            order = [label for label in reversed(post_forward_order) if label in gathering]
            for current, following in itertools.pairwise(order):
                gather = _first(events, Op.ALL_GATHER, following)
                free = _first(events, Op.FREE, current)
                reduction = _first(events, REDUCE_OPS, current)
                if reduction is not None and gather > reduction:
                    failures.append(
                        f"{phase}: {backward_prefetch} did not prefetch: the all-gather of "
                        f"{following!r} was issued after the gradient reduction of "
                        f"{current!r} (expected before)"
                    )
                elif backward_prefetch == "BACKWARD_PRE" and free is not None and gather > free:
                    failures.append(
                        f"{phase}: BACKWARD_PRE prefetched too late: the all-gather of "
                        f"{following!r} was issued after {current!r} freed its parameters "
                        "(expected from its pre-backward, before the free)"
                    )
    return failures


def assert_prefetch_happens(trace: CommTrace, config: dict[str, Any], label: str) -> None:
    """Raise ``CheckFailure`` "prefetch does not happen" listing every configured prefetch the
    trace does not show (figures: ``missed``, how many; ``phases``, where)."""
    failures = prefetch_failures(trace, config)
    phases = ", ".join(dict.fromkeys(failure.partition(":")[0] for failure in failures))
    figures = {"missed": len(failures), "phases": phases}
    raise_failures("prefetch does not happen", label, failures, trace.render(ops=None), **figures)


def raise_failures(
    failure: str, label: str, failures: list[str], rendered_trace: str, **figures: Any
) -> None:
    """``CheckFailure(failure, **figures)`` listing ``failures`` under ``failure (label)``,
    then the trace; none: nothing."""
    if failures:
        lines = "".join(f"\n  {failure}" for failure in failures)
        message = f"{failure} ({label}):{lines}\ntrace:\n{rendered_trace}"
        raise CheckFailure(message, failure, **figures)


def phase_counts(trace: CommTrace) -> str:
    """The figure of collective counts: ``<phase>: N all-gathers, M reductions; ...``."""
    return "; ".join(
        f"{phase}: {trace.count(Op.ALL_GATHER, phase)} all-gathers, "
        f"{trace.count(REDUCE_OPS, phase)} reductions"
        for phase, _, _ in _iteration_phases(trace)
    )


def count_failures(
    trace: CommTrace, strategy: str, no_sync_iterations: tuple[int, ...] = ()
) -> list[str]:
    """Phases whose collectives break what the configuration promises ([Note: counts as
    bounds]); the instances are the trace's labels (every one owns parameters)."""
    labels = list(trace.labels.values())
    failures: list[str] = []
    uses: dict[int, dict[str, int]] = {}  # iteration -> forward all-gathers per instance
    for phase, iteration, kind in _iteration_phases(trace):
        gathers = training.events_per_label(trace, phase, (Op.ALL_GATHER,))
        reductions = training.events_per_label(trace, phase)
        gathered, reduced = sum(gathers.values()), sum(reductions.values())
        if kind == "forward":
            uses[iteration] = gathers
            missing = [label for label in labels if not gathers.get(label)]
            if missing:
                failures.append(
                    f"{phase}: {gathered} all-gathers, expected at least one per instance "
                    f"(every parameter is gathered before use); none for {missing}"
                )
            if reductions:
                failures.append(f"{phase}: {reduced} gradient reductions in forward")
            continue
        used = uses.get(iteration, {})
        if strategy == "SHARD_GRAD_OP" and gathers:
            failures.append(
                f"{phase}: {gathered} all-gathers, expected 0 (SHARD_GRAD_OP keeps "
                "parameters unsharded from forward to backward)"
            )
        elif strategy != "SHARD_GRAD_OP":
            over = {label: n for label, n in gathers.items() if n > used.get(label, 0)}
            if over:
                failures.append(
                    f"{phase}: {gathered} all-gathers, expected at most "
                    f"{sum(used.values())}: no instance gathers more often than in its forward "
                    f"(instance: backward all-gathers {over}, forward {used})"
                )
        if iteration in no_sync_iterations:
            if reductions:
                failures.append(
                    f"{phase} inside no_sync: {reduced} gradient reductions, expected 0"
                )
            continue
        missing = [label for label in labels if not reductions.get(label)]
        over = {label: n for label, n in reductions.items() if n > max(1, used.get(label, 0))}
        if missing or over:
            failures.append(
                f"{phase}: {reduced} gradient reductions, expected every instance's "
                f"gradients reduced once per parameter gathered in its forward: not reduced "
                f"{missing}, reduced more often {over} (forward all-gathers {used})"
            )
    return failures


def assert_counts(
    trace: CommTrace,
    strategy: str,
    instances: int,
    label: str,
    no_sync_iterations: tuple[int, ...] = (),
) -> None:
    """Raise ``CheckFailure`` "collective counts differ" naming each phase whose collective
    counts break a bound (figure ``counts``: ``phase_counts``)."""
    failures = count_failures(trace, strategy, no_sync_iterations)
    label = f"{label}, {strategy}, {instances} instances"
    counts = phase_counts(trace)
    raise_failures("collective counts differ", label, failures, trace.render(), counts=counts)


TRACE_MODELS = ("nested", "transformer")


def prefetch_case_id(model_name: str, backward_prefetch: str | None, forward_prefetch: bool) -> str:
    return f"{model_name}-bwd={backward_prefetch}-fwd={int(forward_prefetch)}"


def prefetch_params() -> list[Any]:
    # (model, backward prefetch, forward prefetch)
    cases = itertools.product(TRACE_MODELS, (None, "BACKWARD_PRE", "BACKWARD_POST"), (False, True))
    return [pytest.param(*case, id=prefetch_case_id(*case)) for case in cases]


def prefetch_config(backward_prefetch: Any, forward_prefetch: bool) -> dict[str, Any]:
    config = {"sharding_strategy": "FULL_SHARD", "backward_prefetch": backward_prefetch}
    if forward_prefetch:
        config["forward_prefetch"] = True
    return config


def describe_config(config: dict[str, Any]) -> str:
    return ", ".join(f"{key}={value!r}" for key, value in config.items())
